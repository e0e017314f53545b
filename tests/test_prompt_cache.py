"""Persisted prompt prefixes (Session.cache_prefix, runtime.prompt_cache): a later session takes a
prefix's KV (and a hybrid model's state) from disk and answers exactly as without it; a file
serves prompts that share only its first blocks; corrupt, foreign or vanished files are ignored
and rebuilt; the directory is bounded; a directory that cannot be written means no cache; and a
fresh process's time to first token under a 1,500-token system prompt drops >= 5x."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_gguf import write_tiny

from hearthlm import Session
from hearthlm.core.errors import InvalidRequestError
from hearthlm.runtime.prompt_cache import SUFFIX

sys.path.insert(0, str(Path(__file__).parent / "parity"))
from models import write as write_parity  # noqa: E402

SYSTEM = [{"role": "system", "content": "you are a tiny model that answers in riddles " * 6}]


def ask(q: str) -> list[dict]:
    return SYSTEM + [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny(tmp_path_factory.mktemp("pc") / "tiny.gguf"))


async def answer(model, cache_dir, messages, **open_kw):
    async with Session.open(model, n_ctx=512, prompt_cache_dir=cache_dir, **open_kw) as s:
        c = await s.generate(messages=messages, max_tokens=12, temperature=0, ignore_eos=True, top_logprobs=1)
        return c.token_ids, [t[0][1] for t in c.top_logprobs], s.stats()


def files(d: Path) -> list[Path]:
    return sorted(d.glob(f"*{SUFFIX}"))


async def test_a_later_session_takes_the_prefix_from_disk(tiny, tmp_path):
    ref = await answer(tiny, None, ask("who?"), prompt_cache=False)
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path) as s:
        n = await s.cache_prefix(messages=SYSTEM)
        ids = s._prompt_ids(None, SYSTEM, generation_prompt=False)
        assert n == len(ids) // 16 * 16 > 0 and len(files(tmp_path)) == 1
        assert await s.cache_prefix(messages=SYSTEM) == n and len(files(tmp_path)) == 1  # not written twice
    ids_, lps, st = await answer(tiny, tmp_path, ask("who?"))
    assert st["prompt_cache_loaded_tokens"] == n and st["prefix_cache_hit_tokens"] == n
    assert ids_ == ref[0] and lps == pytest.approx(ref[1], abs=1e-4)
    # a prompt that shares only the file's first blocks takes those
    short = [{"role": "system", "content": SYSTEM[0]["content"][:100]}, {"role": "user", "content": "hm"}]
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path) as s:
        shared = len(s._prompt_ids(None, short[:1], generation_prompt=False))
        await s.generate(messages=short, max_tokens=2)
        assert 0 < s.stats()["prompt_cache_loaded_tokens"] <= shared
        assert s.stats()["prompt_cache_loaded_tokens"] == (shared - 1) // 16 * 16 or shared % 16 == 0


async def test_a_hybrid_model_persists_its_state(tmp_path):
    model = str(write_parity(tmp_path / "lfm2.gguf", "lfm2"))
    prefix = [(7 * i) % 250 + 3 for i in range(70)]
    full = prefix + [5, 9, 11, 13, 17]
    async with Session.open(model, n_ctx=256, prompt_cache=False) as s:
        ref = await s.generate(full, max_tokens=8, temperature=0, ignore_eos=True, top_logprobs=1)
    async with Session.open(model, n_ctx=256, prompt_cache_dir=tmp_path) as s:
        assert await s.cache_prefix(prefix) == 64  # up to the state snapshot at the last block boundary
    async with Session.open(model, n_ctx=256, prompt_cache_dir=tmp_path) as s:
        c = await s.generate(full, max_tokens=8, temperature=0, ignore_eos=True, top_logprobs=1)
        st = s.stats()
        assert st["prompt_cache_loaded_tokens"] == 64 and st["state_snapshots"] >= 1
        # a prompt that leaves the file before its end cannot start from its state: recomputed
        await s.generate(prefix[:40] + [1, 2, 3], max_tokens=1)
        assert s.stats()["prompt_cache_loaded_tokens"] == 64
    assert c.token_ids == ref.token_ids
    assert [t[0][1] for t in c.top_logprobs] == pytest.approx([t[0][1] for t in ref.top_logprobs], abs=1e-4)


def _damaged(f: Path, other: Path):
    data = f.read_bytes()
    yield "flipped data byte", data[:-100] + bytes([data[-100] ^ 0x10]) + data[-99:]
    yield "truncated", data[:len(data) // 2]
    yield "bad magic", b"XX" + data[2:]
    yield "another model's file", other.read_bytes()


async def test_bad_files_are_ignored_and_rebuilt(tiny, tmp_path):
    other_model = str(write_tiny(tmp_path / "other.gguf", seed=1))
    ref = await answer(tiny, None, ask("who?"), prompt_cache=False)
    async with Session.open(other_model, n_ctx=512, prompt_cache_dir=tmp_path / "o") as s:
        await s.cache_prefix(messages=SYSTEM)
    other, = files(tmp_path / "o")
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path / "p") as s:
        await s.cache_prefix(messages=SYSTEM)
    f, = files(tmp_path / "p")
    good = f.read_bytes()
    for what, bad in _damaged(f, other):
        f.write_bytes(bad)
        ids, lps, st = await answer(tiny, tmp_path / "p", ask("who?"))
        assert (ids, st["prompt_cache_loaded_tokens"]) == (ref[0], 0), what
        assert not f.exists(), what  # removed, not read again
        async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path / "p") as s:
            assert await s.cache_prefix(messages=SYSTEM) > 0
        assert f.read_bytes() == good, what  # rebuilt as it was


async def test_vanished_file_and_unwritable_directory(tiny, tmp_path):
    ref = await answer(tiny, None, ask("who?"), prompt_cache=False)
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path) as s:
        await s.cache_prefix(messages=SYSTEM)
        s.engine.memory.prompts.longest(["x"])  # indexed now
        files(tmp_path)[0].unlink()  # another process evicted it
        s.engine.memory.prompts._seen = tmp_path.stat().st_mtime_ns  # the index still names it
        c = await s.generate(messages=ask("who?"), max_tokens=12, temperature=0, ignore_eos=True)
        assert c.token_ids == ref[0]
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=blocker / "prompts") as s:
        assert await s.cache_prefix(messages=SYSTEM) == 0  # nothing written, nothing broken
        assert "cannot write" in s.engine.memory.prompts.problem
        c = await s.generate(messages=ask("who?"), max_tokens=12, temperature=0, ignore_eos=True)
        assert c.token_ids == ref[0]


async def test_the_directory_is_bounded_least_recently_used_first(tiny, tmp_path):
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path) as s:
        await s.cache_prefix(messages=SYSTEM)
        one = files(tmp_path)[0].stat().st_size
    async with Session.open(tiny, n_ctx=512, prompt_cache_dir=tmp_path, prompt_cache_bytes=int(2.5 * one)) as s:
        for i in range(4):
            await s.cache_prefix(messages=[{"role": "system", "content": f"{i} " + SYSTEM[0]["content"]}])
        st = s.stats()
    assert len(files(tmp_path)) == 2 and st["prompt_cache_files"] == 2 and st["prompt_cache_files_written"] == 4
    assert sum(f.stat().st_size for f in files(tmp_path)) <= 2.5 * one


async def test_bad_arguments(tiny, tmp_path):
    with pytest.raises(InvalidRequestError, match="prompt_cache must be"):
        async with Session.open(tiny, prompt_cache="yes"):
            pass
    async with Session.open(tiny, n_ctx=64, prompt_cache=False) as s:
        assert await s.cache_prefix("a short prefix") == 0  # computed and held in memory only
        with pytest.raises(InvalidRequestError, match="exactly one"):
            await s.cache_prefix()


FRESH = r"""
import asyncio, json, sys, time
from hearthlm import Session
model, cache, mode = sys.argv[1], sys.argv[2], sys.argv[3]
system = [{"role": "system", "content": open(sys.argv[4]).read()}]
async def main():
    async with Session.open(model, n_ctx=2048, prompt_cache=mode != "off", prompt_cache_dir=cache) as s:
        if mode == "write":
            print(json.dumps({"persisted": await s.cache_prefix(messages=system)}))
            return
        t0, first, ids = time.perf_counter(), None, []
        async for c in s.stream(messages=system + [{"role": "user", "content": "Summarize the text."}],
                                max_tokens=16, temperature=0):
            first = first or time.perf_counter() - t0
            ids += c.token_ids
        print(json.dumps({"ttft": first, "ids": ids, "loaded": s.stats().get("prompt_cache_loaded_tokens", 0)}))
asyncio.run(main())
"""


@pytest.mark.slow
def test_fresh_process_time_to_first_token(smollm2_path, tmp_path):
    """Three fresh processes on SmolLM2 under a ~1,500-token system prompt: one writes the prefix,
    one answers with it, one without; the same answer, the first token >= 5x sooner."""
    text = Path(__file__).parent / "data" / "ppl_text.txt"
    system = tmp_path / "system.txt"
    system.write_text(text.read_text()[:7700])

    def run(mode):
        out = subprocess.run([sys.executable, "-c", FRESH, str(smollm2_path), str(tmp_path / "p"), mode, str(system)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    persisted = run("write")["persisted"]
    assert 1400 <= persisted <= 1700, persisted
    warm, cold = run("warm"), run("off")
    assert warm["loaded"] == persisted and cold["loaded"] == 0
    assert warm["ids"] == cold["ids"] and len(warm["ids"]) > 0
    assert cold["ttft"] >= 5 * warm["ttft"], (cold["ttft"], warm["ttft"])
