"""Hostile model files and hostile requests: a chat template is untrusted data, so each kind
of attack on the renderer ends in InvalidRequestError within about a second, with little
memory, and the session stays usable; per-request limits refuse oversize requests by name;
a KV cache that cannot fit fails at open."""
import time
import tracemalloc

import pytest
from tiny_gguf import write_tiny

from hearthlm import ContextLengthError, InvalidRequestError, Session, TemplateLimits
from hearthlm.model_zoo.chat_template import render_chat
from hearthlm.model_zoo.template_limits import TemplateLimitError

HI = [{"role": "user", "content": "hi"}]
HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "string doubling": "{% set s = 'ab' %}" + "{% set s = s ~ s %}" * 64 + "{{ s }}",
    "namespace doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                          "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "repeat": "{{ 'a' * 10 ** 9 }}",
    "power": "{{ 7 ** 9999999 }}",
    "wide format": "{{ '%999999999d' % 1 }}",
    "wide str.format": "{{ '{:>999999999}'.format(1) }}",
    "wide format filter": "{{ '%999999999d'|format(1) }}",
    "center": "{{ 'a'|center(999999999) }}",
    "join separator": "{{ range(100000)|join('x' * 1000) }}",
    "replace": "{% set s = 'a' * 3000 %}{{ s|replace('a', s) }}",
    "output": "{% set s = 'a' * 3000000 %}{% for i in range(10) %}{{ s }}{% endfor %}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% for m in [[1]] recursive %}{{ loop([m]) }}{% endfor %}",
    "__class__": "{{ messages.__class__ }}",
    "__subclasses__": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "__globals__": "{{ raise_exception.__globals__ }}",
    "getattr escape": "{{ (messages|attr('__class__')).__base__ }}",
    "format escape": "{{ '{0.__class__.__mro__}'.format('') }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_fails_fast_and_small(name):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(InvalidRequestError):
            render_chat(HOSTILE[name], HI)
        took = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert took < 2.5, f"{name}: {took:.2f} s"  # the limit is 1 s; the rest is slack for a loaded machine
    assert peak < 100e6, f"{name}: {peak / 1e6:.0f} MB"


def test_limits_are_configurable_and_named():
    loop = "{% for i in range(5000) %}{{ i }}{% endfor %}"
    assert render_chat(loop, HI).startswith("0123")
    with pytest.raises(TemplateLimitError, match="steps"):
        render_chat(loop, HI, limits=TemplateLimits(steps=1000))
    with pytest.raises(TemplateLimitError, match="rendered more than"):
        render_chat(loop, HI, limits=TemplateLimits(output_chars=100))
    with pytest.raises(TemplateLimitError, match="items"):
        render_chat("{{ 'ab' * 60 }}", HI, limits=TemplateLimits(value_len=100))


# long loops within every limit but time: tens of seconds each without the clock. In template
# code (lines traced; the inner range made once, so no call reaches the calls' check) and in a
# filter's Python loop (calls traced; few lines): the two places the deadline is checked, one each
SLOW = {"template lines": ("{% set r = range(100000) %}{% for i in range(100) %}{% for j in r %}{% set x = j %}"
                           "{% endfor %}{% endfor %}", TemplateLimits(steps=10**9)),
        "filter calls": ("{% for i in range(50) %}{{ range(100000)|select('odd')|list|length }}{% endfor %}",
                         TemplateLimits())}


@pytest.mark.parametrize("name", list(SLOW))
def test_render_stops_at_its_time_limit(name):
    """A template that would loop for tens of seconds within every other limit fails with the
    time limit's error after about its 1 s. Mutations (model_zoo/template_limits.py): Budget._line's
    deadline check removed renders "template lines" to the end (10-60 s here) without an error,
    Budget.trace's the same for "filter calls"."""
    template, limits = SLOW[name]
    t0 = time.perf_counter()
    with pytest.raises(TemplateLimitError, match=r"longer than 1\.0 s"):
        render_chat(template, HI, limits=limits)
    took = time.perf_counter() - t0
    assert 0.9 < took < 2.5, f"{name}: {took:.2f} s"  # slack for a loaded machine


def test_real_templates_render_unchanged_within_the_limits():
    """A 2,000-message chat under the shipped templates stays far below every default."""
    from conftest import DATA
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(2000)]
    for name in ("smollm2_chat_template.jinja", "gemma3_chat_template.jinja"):
        text = render_chat((DATA / name).read_text(), msgs, bos_token="<s>")
        assert "message 1999" in text and text.count("message ") == 2000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("hostile") / "tiny.gguf"))


async def test_session_survives_a_hostile_template(tiny):
    async with Session.open(tiny, n_ctx=64) as s:
        good = await s.generate(messages=HI, max_tokens=4, temperature=0)
        own = s.model.chat_template
        for name in ("nested loops", "string doubling", "recursive macro", "__subclasses__"):
            s.model.chat_template = HOSTILE[name]
            t0 = time.perf_counter()
            with pytest.raises(InvalidRequestError):
                await s.generate(messages=HI, max_tokens=4)
            assert time.perf_counter() - t0 < 2.0, name
        s.model.chat_template = own
        again = await s.generate(messages=HI, max_tokens=4, temperature=0)
        assert again.token_ids == good.token_ids and s.health()["ok"]


async def test_request_limits_name_the_problem(tiny):
    async with Session.open(tiny, n_ctx=64) as s:
        with pytest.raises(InvalidRequestError, match="messages"):
            await s.generate(messages=HI * 10_001, max_tokens=1)
        with pytest.raises(InvalidRequestError, match="stop strings"):
            await s.generate("hi", stop=[f"s{i}" for i in range(65)], max_tokens=1)
        with pytest.raises(InvalidRequestError, match="stop string of 1001"):
            await s.generate("hi", stop="x" * 1001, max_tokens=1)
        with pytest.raises(InvalidRequestError, match="top_logprobs"):
            await s.generate("hi", top_logprobs=21, max_tokens=1)
        with pytest.raises(ContextLengthError, match="characters"):
            await s.generate("a" * (64 * 64 + 1), max_tokens=1)
        assert (await s.generate("hi", max_tokens=2)).token_ids  # still serving


async def test_kv_cache_that_cannot_fit_fails_at_open(tiny, monkeypatch):
    from hearthlm.backends.cpu.backend import CPUBackend
    monkeypatch.setattr(CPUBackend, "memory_available", lambda self: 1 << 16)  # 64 KiB free
    with pytest.raises(InvalidRequestError, match=r"KV cache .* needs .* GiB on cpu"):
        async with Session.open(tiny, n_ctx=512):
            pass
