"""SessionOptions, the one declaration of Session.open's options: every CLI command that opens a
model has a flag for each, the flags reach Session.open, Session.open/SyncSession/build_app
take the same keywords with the same defaults, and a bad value is refused naming its option."""
from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import fields, replace

import anyio
import pytest
from tiny_gguf import write_tiny

from hearthlm import HearthError, InvalidRequestError, Session, SessionOptions, SyncSession, TemplateLimits, cli, options
from hearthlm.session import Session as _Session

MODEL_COMMANDS = ("generate", "chat", "serve", "bench", "perplexity")
CLI_FIELDS = [f for f in fields(SessionOptions) if f.metadata["cli"]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("options") / "tiny.gguf"))


def _subparser(cmd: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[cmd]


# ---- every option is a flag of every command that opens a model -----------------------------

@pytest.mark.parametrize("cmd", MODEL_COMMANDS)
def test_every_option_is_a_flag(cmd):
    """Mutation: serve's add_serve_args calling options.add_arguments(p, only=[...]) without
    n_gpu_layers (or a field marked cli=False) fails here: that command lacks the flag."""
    p = _subparser(cmd)
    have = {s: a.dest for a in p._actions for s in a.option_strings}
    for f in CLI_FIELDS:
        for flag in options.flags_of(f.name):
            assert have.get(flag) == f.name, f"`hearthlm {cmd}` has no {flag} for {f.name}"
    assert [f.name for f in fields(SessionOptions) if not f.metadata["cli"]] == ["progress"]  # a callable


def test_serve_help_lists_every_option():
    """`hearthlm serve --help` names each option, device and n_gpu_layers among them.
    Mutation: add_arguments skipping fields whose default is None drops --device here."""
    text = _subparser("serve").format_help()
    for f in CLI_FIELDS:
        assert options.flags_of(f.name)[0] in text, f.name
    assert "--device {cpu,cuda,auto}" in text and "--n-gpu-layers N" in text
    assert "--max-queued N" in text  # the flag serve had before, kept


FLAGS = ["--device", "cuda", "--n-gpu-layers", "2", "--n-ctx", "96", "--max-queued", "7", "--max-seqs", "3",
         "--no-fusion", "--no-abort-on-close", "--template-limits", "seconds=2,steps=500", "--weight-cache", "off",
         "--kv-cache-type", "q8_0", "--draft-p-min", "0.5", "--prompt-cache-bytes", "1000"]
WANT = dict(device="cuda", n_gpu_layers=2, n_ctx=96, max_queued_requests=7, max_seqs=3, fusion=False,
            abort_on_close=False, template_limits=TemplateLimits(seconds=2.0, steps=500), weight_cache="off",
            kv_cache_type="q8_0", draft_p_min=0.5, prompt_cache_bytes=1000)


@pytest.mark.parametrize("cmd", ["generate", "chat", "perplexity", "bench"])
def test_flags_reach_session_open(cmd, tiny, tmp_path, monkeypatch):
    """What each command passes to Session.open: its flags as given, defaults where none is,
    and a command's own defaults (bench's batch of max(512, --prompt-tokens), perplexity's
    n_ctx = --ctx) only where no flag is given. Mutation: chat_cmd opening with
    `n_ctx=a.n_ctx, backend=a.backend` (the hand copy it had) instead of options=from_args(a)
    drops every other flag here."""
    seen = []

    def fake_open(model, *, options=None, **kw):
        seen.append(SessionOptions.of(options, kw))
        raise HearthError("stop here")
    monkeypatch.setattr(_Session, "open", fake_open)
    text = tmp_path / "t.txt"
    text.write_text("a b c " * 100)
    lead = {"generate": ["generate", "hi"], "chat": ["chat"], "perplexity": ["perplexity", str(text)],
            "bench": ["bench", "--prompt-tokens", "600"]}[cmd]
    assert cli.main([*lead, "--model", tiny, *FLAGS]) == 1
    assert seen[-1] == SessionOptions(**WANT) if cmd != "bench" else replace(SessionOptions(**WANT), max_batch_tokens=600)
    assert cli.main([*lead, "--model", tiny]) == 1
    own = {"perplexity": dict(n_ctx=512), "bench": dict(max_batch_tokens=600)}.get(cmd, {})
    assert seen[-1] == SessionOptions(**own)
    if cmd == "bench":  # a flag given wins over bench's own default
        assert cli.main([*lead, "--model", tiny, "--max-batch-tokens", "64"]) == 1
        assert seen[-1].max_batch_tokens == 64


def test_serve_flags_reach_build_app(monkeypatch):
    """Mutation: run_serve passing only some options to build_app (as it once passed n_ctx,
    max_seqs, ... by hand) fails on the fields left out."""
    pytest.importorskip("uvicorn")
    import uvicorn

    from hearthlm.serve import app, server
    seen = {}
    monkeypatch.setattr(app, "build_app", lambda models, **kw: seen.update(kw))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    server.run_serve(_subparser("serve").parse_args(["m.gguf", *FLAGS]))
    kw = {k: v for k, v in seen.items() if k in options.NAMES}
    assert SessionOptions(**kw) == SessionOptions(**WANT) and len(kw) == len(options.NAMES)


# ---- one default per option ------------------------------------------------------------------

@pytest.mark.parametrize("fn", [_Session.open, SyncSession.__init__, "build_app"])
def test_signatures_take_every_option_with_its_default(fn):
    """Mutation: Session.open given a keyword of its own, `n_ctx: int = 4096`, beside **kwargs
    (takes_options keeps an explicit one) shows the disagreement here."""
    if fn == "build_app":
        pytest.importorskip("fastapi")
        from hearthlm.serve.app import build_app as fn
    params = inspect.signature(fn).parameters
    for f in fields(SessionOptions):
        assert f.name in params and params[f.name].default == f.default, f.name
    assert "options" in params


def test_what_load_gets_by_default(tiny, monkeypatch):
    """Session.open, SyncSession and the CLI with no options all open with SessionOptions().
    Mutation: `kwargs.setdefault("n_ctx", 4096)` in Session.open (a default of its own) fails
    here."""
    seen = []

    def fake_load(cls, model, o):
        seen.append(o)
        raise HearthError("stop here")
    monkeypatch.setattr(_Session, "_load", classmethod(fake_load))

    async def go():
        async with Session.open(tiny):
            pass
    with pytest.raises(HearthError, match="stop here"):
        anyio.run(go)
    with pytest.raises(HearthError, match="stop here"):
        SyncSession(tiny)
    assert cli.main(["generate", "hi", "--model", tiny]) == 1
    assert seen == [SessionOptions()] * 3


async def test_options_and_keywords_together(tiny):
    """Keywords win over `options=`. Mutation: SessionOptions.of ignoring kwargs when options is
    given leaves max_seqs at 64."""
    async with Session.open(tiny, options=SessionOptions(n_ctx=64, max_seqs=8), max_seqs=2) as s:
        assert s.n_ctx == 64 and s.engine.max_seqs == 2
    with pytest.raises(TypeError, match="options must be a SessionOptions"):
        async with Session.open(tiny, options={"n_ctx": 64}):
            pass
    with pytest.raises(TypeError, match="bogus"):
        Session.open(tiny, bogus=1)  # at the call, as for any unknown keyword


# ---- bad values name their option --------------------------------------------------------------

@pytest.mark.parametrize("name", options.NAMES)
def test_a_value_of_the_wrong_kind_names_the_option(name):
    """Mutation: Kind.why's message without `{name}` (or a field's check accepting anything)
    fails here, for every field."""
    with pytest.raises(InvalidRequestError, match=rf"\b{name}\b"):
        SessionOptions(**{name: object()})


@pytest.mark.parametrize("kw", [dict(n_ctx=1), dict(max_seqs=0), dict(max_batch_tokens=-1), dict(max_queued_requests=0),
                                dict(kv_cache_tokens=-5), dict(prompt_cache_bytes=-1), dict(draft_p_min=2),
                                dict(draft_p_min=True), dict(n_gpu_layers=-1, device="cuda"), dict(device="tpu"),
                                dict(kv_cache_type="q8"), dict(prompt_cache="yes"), dict(fusion=1),
                                dict(n_ctx=2048.0)])
def test_a_value_out_of_range_names_the_option(kw):
    """Mutation: INT1's check `v >= 1` made `v >= 0` lets max_seqs=0 (and max_queued_requests=0)
    through here."""
    (name, value), = kw.items() if len(kw) == 1 else [(k, v) for k, v in kw.items() if k != "device"]
    with pytest.raises(InvalidRequestError, match=rf"\b{name}\b"):
        SessionOptions(**kw)


@pytest.mark.parametrize("kw, words", [(dict(backend="reference", device="cpu"), "not both"),
                                       (dict(n_gpu_layers=2), "n_gpu_layers needs device"),
                                       (dict(device="cpu", n_gpu_layers=2), "n_gpu_layers=2 needs")])
def test_options_that_contradict(kw, words):
    with pytest.raises(InvalidRequestError, match=words):
        SessionOptions(**kw)


def test_bad_values_from_each_door(tiny, capsys):
    """Session.open (on entering, as before), the CLI (exit 1, `hearthlm: error:`) and key=value
    strings (Ray's `serve run`) refuse a bad value naming it."""
    async def go():
        async with Session.open(tiny, max_seqs=0):
            pass
    with pytest.raises(InvalidRequestError, match="max_seqs must be an int >= 1, got 0"):
        anyio.run(go)
    assert cli.main(["generate", "hi", "--model", tiny, "--max-seqs", "0"]) == 1
    assert "hearthlm: error: max_seqs must be" in capsys.readouterr().err
    with pytest.raises(InvalidRequestError, match="n_ctx"):
        SessionOptions.from_strings({"n_ctx": "many"})
    with pytest.raises(SystemExit):  # argparse's own: not an int
        cli.main(["generate", "hi", "--max-seqs", "x"])


def test_from_strings_reads_each_kind():
    """Ray's `serve run ... key=value` arguments. Mutation: from_strings passing values through
    unparsed leaves n_ctx the string "256"."""
    o = SessionOptions.from_strings({"n_ctx": "256", "fusion": "false", "weight_cache": "off", "draft_p_min": "0.5",
                                     "template_limits": "seconds=3", "device": "auto", "n_gpu_layers": "4"})
    assert o == SessionOptions(n_ctx=256, fusion=False, weight_cache="off", draft_p_min=0.5,
                               template_limits=TemplateLimits(seconds=3.0), device="auto", n_gpu_layers=4)
    with pytest.raises(TypeError, match="bogus"):
        SessionOptions.from_strings({"bogus": "1"})


def test_exported_and_documented():
    import hearthlm
    assert "SessionOptions" in hearthlm.__all__ and hearthlm.SessionOptions is SessionOptions
    for f in fields(SessionOptions):  # each option's help in Session.open's doc
        assert f.metadata["help"] in Session.open.__doc__
    assert os.path.basename(inspect.getfile(SessionOptions)) == "options.py"
