"""Thinking apart from the answer: the splitter on outputs as each format's models write them
(fed whole, a character at a time and in random pieces), detection from the template, the
reasoning budget, and live: a tiny model whose template opens <think>, through the Session and
the server, and Qwen2.5 with its template made to open <think>."""
from __future__ import annotations

import random

import pytest
from tiny_gguf import CHATML, write_tiny

from hearthlm import Session
from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo import reasoning
from hearthlm.model_zoo.reasoning import GEMMA4, HARMONY, THINK, ReasoningSplitter
from hearthlm.runtime.request import ThinkBudget

# outputs in each format, as the models write them (opened: the prompt opened the thinking)
OUTPUTS = [
    # Qwen3: the model opens <think> itself
    ("qwen3", THINK, False, "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
     "\nThe user wants 2+2. That is 4.\n", "The answer is **4**."),
    # Qwen3 with enable_thinking=False (the template closed an empty thinking): the answer only
    ("qwen3-nothink", THINK, False, "The answer is 4.", "", "The answer is 4."),
    # DeepSeek-R1 (and its distills), Qwen3.5: the generation prompt ends with "<think>\n"
    ("deepseek-r1", THINK, True, "Okay, so 2+2... that's 4.\n</think>\n\n2 + 2 = 4", "Okay, so 2+2... that's 4.\n",
     "2 + 2 = 4"),
    # a thinking that never closes (cut by max_tokens): all of it is thinking
    ("r1-cut", THINK, True, "Let me think about <this", "Let me think about <this", ""),
    # an answer that mentions the marker later stays an answer
    ("late-tag", THINK, False, "Use <think> tags like this.", "", "Use <think> tags like this."),
    # gpt-oss (harmony): analysis channel, then the final one
    ("gpt-oss", HARMONY, False, "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant"
     "<|channel|>final<|message|>2 + 2 = 4.", "User asks 2+2. Answer 4.", "2 + 2 = 4."),
    ("gpt-oss-final-only", HARMONY, False, "<|channel|>final<|message|>Four.", "", "Four."),
    # Gemma 4: a thought channel, then the answer; or none (thinking off: the prompt closed an empty one)
    ("gemma4", GEMMA4, False, "<|channel>thought\nThe user greets.<channel|>Hello!", "The user greets.", "Hello!"),
    ("gemma4-no-thought", GEMMA4, False, "Hello there.", "", "Hello there."),
    # a tool call after the analysis: handed on whole to the tool-call parser (tool_calls.Harmony)
    ("gpt-oss-call", HARMONY, False, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}", "Need the weather.",
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}"),
]


def split(fmt, opened, pieces) -> tuple[str, str]:
    sp, think, answer = ReasoningSplitter(fmt, opened=opened), [], []
    for i, p in enumerate(pieces):
        t, a = sp.feed(p, final=i == len(pieces) - 1)
        think.append(t)
        answer.append(a)
    return "".join(think), "".join(answer)


@pytest.mark.parametrize("case", OUTPUTS, ids=[c[0] for c in OUTPUTS])
def test_splitter_on_each_format(case):
    _, fmt, opened, text, want_think, want_answer = case
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    pieces_random = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for pieces in ([text], list(text), pieces_random, [text, ""]):
        assert split(fmt, opened, pieces) == (want_think, want_answer), pieces


def test_detect_from_the_template():
    qwen3 = CHATML + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    assert reasoning.detect(qwen3) is THINK
    assert reasoning.detect("{{'<｜Assistant｜><think>\\n'}}") is THINK
    assert reasoning.detect("{{'<|start|>assistant<|channel|>analysis<|message|>'}}") is HARMONY
    assert reasoning.detect(CHATML) is None and reasoning.detect(None) is None
    assert reasoning.opened_by_prompt(THINK, "<|im_start|>assistant\n<think>\n")
    assert not reasoning.opened_by_prompt(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.opened_by_prompt(HARMONY, "<|start|>assistant")
    gemma4 = "{{ '<|turn>model\n' }}{% if not enable_thinking %}{{ '<|channel>thought\n<channel|>' }}{% endif %}"
    assert reasoning.detect(gemma4) is GEMMA4
    assert not reasoning.opened_by_prompt(GEMMA4, "<|turn>model\n<|channel>thought\n<channel|>")


def test_think_budget_counts_thinking_tokens_only():
    pieces = {1: b"<think>", 2: b"a", 3: b"</think>", 4: b"<th", 5: b"ink>"}
    b = ThinkBudget(2, b"<think>", b"</think>", [9, 9], pieces.__getitem__)
    assert [b.after(t) for t in (2, 4, 5, 2)] == [[], [], [], []]  # the marker split over two tokens opens it
    assert b.after(2) == [9, 9] and b.done and b.after(2) == []   # the second thinking token closes it
    own = ThinkBudget(3, b"<think>", b"</think>", [9], pieces.__getitem__, thinking=True)
    assert [own.after(t) for t in (2, 3, 2, 2, 2)] == [[]] * 5 and own.done  # the model closed it itself
    zero = ThinkBudget(0, b"<think>", b"</think>", [9], pieces.__getitem__)
    assert zero.after(1) == [9]


# a template that opens the thinking in its generation prompt, unless enable_thinking is false
OPENS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
         "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
         "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("think") / "thinker.gguf", chat_template=OPENS))


async def test_session_splits_and_budgets_thinking(thinker):
    async with Session.open(thinker, n_ctx=512, weight_cache=False) as s:
        tok = s.model.tokenizer
        raw = await s.generate(messages=MSGS, max_tokens=24, temperature=0, reasoning_format="none")
        assert raw.reasoning == "" and "</think>" not in raw.text
        c = await s.generate(messages=MSGS, max_tokens=24, temperature=0)
        assert c.token_ids == raw.token_ids and c.reasoning == raw.text and c.text == ""  # never closed
        # a budget of 6: six tokens of thinking, then the closing marker fed, then the answer
        close = tok.encode(THINK.feed_close, parse_special=True)
        b = await s.generate(messages=MSGS, max_tokens=24, temperature=0, reasoning_budget=6)
        assert b.token_ids[:6] == c.token_ids[:6] and b.token_ids[6:6 + len(close)] == close
        assert b.reasoning == tok.decode(b.token_ids[:6]) + "\n"  # the fed marker's leading newline
        assert b.text == tok.decode(b.token_ids[6 + len(close):]).lstrip() and len(b.token_ids) == 24
        # streamed: all the thinking comes before any answer, and the pieces add up
        chunks = [x async for x in s.stream(messages=MSGS, max_tokens=24, temperature=0, reasoning_budget=6)]
        assert "".join(x.reasoning for x in chunks) == b.reasoning and "".join(x.text for x in chunks) == b.text
        first_answer = next(i for i, x in enumerate(chunks) if x.text)
        assert not any(x.reasoning for x in chunks[first_answer + 1:])  # a coalesced chunk may hold both
        # budget 0: closed in the prompt, so the output is all answer
        z = await s.generate(messages=MSGS, max_tokens=8, temperature=0, reasoning_budget=0)
        assert z.reasoning == "" and z.text
        # template variables: enable_thinking=False closes it in the template
        off = await s.generate(messages=MSGS, max_tokens=8, temperature=0, chat_template_kwargs={"enable_thinking": False})
        assert off.reasoning == "" and off.text == z.text
        for bad in ({"messages": []}, {"not a name": 1}, ["enable_thinking"]):
            with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
                await s.generate(messages=MSGS, max_tokens=2, chat_template_kwargs=bad)
        with pytest.raises(InvalidRequestError, match="reasoning_budget"):
            await s.generate(messages=MSGS, max_tokens=2, reasoning_budget=-1)
        # a plain prompt is not a chat: nothing is split
        p = await s.generate("<think>\nabc", max_tokens=6, temperature=0)
        assert p.reasoning == ""
        assert s.stats()["kv_blocks_used"] == 0


def test_server_reasoning_content(thinker):
    openai = pytest.importorskip("openai")
    from serve_util import live_server
    with live_server(thinker, "--n-ctx", "512") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=thinker, messages=MSGS, max_tokens=24, temperature=0,
                                      extra_body={"reasoning_budget": 6})
        msg = r.choices[0].message
        think = msg.model_extra["reasoning_content"]
        assert think and msg.content and "</think>" not in msg.content + think
        chunks = list(c.chat.completions.create(model=thinker, messages=MSGS, max_tokens=24, temperature=0, stream=True,
                                                extra_body={"reasoning_budget": 6}))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        got = [(d.model_extra.get("reasoning_content") or "", d.content or "") for d in deltas]
        assert "".join(t for t, _ in got) == think and "".join(a for _, a in got) == msg.content
        first_content = next(i for i, (_, a) in enumerate(got) if a)
        # reasoning before any content (a chunk of several tokens, as a busy stream coalesces them,
        # may end the one and begin the other: its reasoning_content comes first)
        assert not any(t for t, _ in got[first_content + 1:])
        off = c.chat.completions.create(model=thinker, messages=MSGS, max_tokens=8, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert not off.choices[0].message.model_extra.get("reasoning_content")
        raw = c.chat.completions.create(model=thinker, messages=MSGS, max_tokens=24, temperature=0,
                                        extra_body={"reasoning_budget": 6, "reasoning_format": "none"})
        assert "</think>" in raw.choices[0].message.content


async def test_chat_template_given_at_open_replaces_the_files(tmp_path):
    """Session.open(chat_template=...) renders chats with that template, thinking detected from
    it; one with a syntax error fails the open, naming its line. Mutations seen to fail: the
    option not set on the model (no thinking detected from it); the template not
    compiled at open (the open succeeded)."""
    plain = str(write_tiny(tmp_path / "plain.gguf"))  # CHATML: no thinking
    async with Session.open(plain, n_ctx=512, weight_cache=False) as s:
        a = await s.generate(messages=MSGS, max_tokens=4, temperature=0, reasoning_format="none")
        opened = len(s.tokenize("<think>\n", add_special=False))
    async with Session.open(plain, n_ctx=512, weight_cache=False, chat_template=OPENS) as s:
        assert reasoning.detect(s.model.chat_template) is not None
        b = await s.generate(messages=MSGS, max_tokens=4, temperature=0, reasoning_format="none")
        c = await s.generate(messages=MSGS, max_tokens=4, temperature=0)
    assert b.prompt_tokens == a.prompt_tokens + opened
    assert c.reasoning == b.text  # cut short inside the thinking the prompt opened
    with pytest.raises(InvalidRequestError, match=r"syntax error \(line 2\)"):
        async with Session.open(plain, n_ctx=512, weight_cache=False, chat_template="{{ messages }}\n{% for m in %}"):
            pass


async def test_qwen25_with_a_template_that_thinks(qwen2_path):
    """The real model, its own template made to open <think> in the generation prompt, given as
    Session.open's chat_template (the file's packed weights reused: a copy of the file with the
    template edited in packed them all again, 30 s of the suite's time)."""
    import gguf
    r = gguf.GGUFReader(str(qwen2_path))
    tpl = r.fields["tokenizer.chat_template"].contents()
    opened = tpl.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert opened != tpl
    del r
    msgs = [{"role": "user", "content": "What is 2+2? Think first."}]
    async with Session.open(str(qwen2_path), n_ctx=512, chat_template=opened) as s:
        raw = await s.generate(messages=msgs, max_tokens=48, temperature=0, reasoning_format="none")
        c = await s.generate(messages=msgs, max_tokens=48, temperature=0)
        assert c.token_ids == raw.token_ids
        head, sep, rest = raw.text.partition("</think>")
        assert c.reasoning == head and c.text == (rest.lstrip() if sep else "") and c.reasoning
        b = await s.generate(messages=msgs, max_tokens=48, temperature=0, reasoning_budget=8)
        assert b.token_ids[:8] == raw.token_ids[:8] and b.reasoning == s.detokenize(raw.token_ids[:8]) + "\n"
        assert b.text and "</think>" not in b.text and "<think>" not in b.reasoning
