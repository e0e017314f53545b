"""`hearthlm bench --compare-llama-cpp`'s one yardstick: llama.cpp's side of every mode runs in the
interpreter --llama-cpp-python names, as one child (hearthlm/bench/llama_cpp_side.py, a JSON command
a line), and every report names the host and the build. The protocol is driven here against a fake
llama_cpp module on a temporary PYTHONPATH (CI has no llama-cpp-python), and once against the
shared build (/tmp/lcp-venv, skipped where it is absent)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hearthlm.bench import yardstick
from hearthlm.bench.yardstick import LlamaCppSide, interpreter
from hearthlm.core.errors import InvalidRequestError

REAL = os.environ.get(yardstick.ENV_PYTHON, "/tmp/lcp-venv/bin/python")

# a llama_cpp with what the side calls; each call appended to $FAKE_LLAMA_LOG as a JSON line
FAKE = '''
import json, os, time
__version__ = "0.0-fake"

def _log(**kw):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\\n")

def llama_print_system_info():
    return b"CPU : FAKE = 1 | "

LLAMA_POOLING_TYPE_NONE, LLAMA_POOLING_TYPE_MEAN = 0, 1

def llama_pooling_type(ctx):
    return ctx

def llama_get_embeddings_seq(ctx, i):
    return [float(i)]

class _Batch:
    def reset(self): self.n = 0
    def add_sequence(self, ids, i, logits): self.n += len(ids)

class _Ctx:
    def __init__(self, pooling):
        self.ctx = pooling
    def kv_cache_clear(self): pass
    def decode(self, batch): _log(op="decode", tokens=batch.n)

class Llama:
    def __init__(self, model_path, n_ctx, n_threads=None, n_threads_batch=None, n_batch=512, verbose=True, **kw):
        self.n_batch, self._batch, self._ctx = n_batch, _Batch(), _Ctx(kw.get("pooling_type", 0))
        _log(op="init", path=model_path, n_ctx=n_ctx, threads=n_threads, threads_batch=n_threads_batch, **kw)
        print("llama.cpp chatter on stdout")  # must not reach the answers' channel
    def reset(self): pass
    def close(self): pass
    def eval(self, ids):
        time.sleep(0.001)
        _log(op="eval", ids=list(ids))
    def generate(self, ids, temp=0.0, top_k=1, reset=True):
        _log(op="generate", ids=list(ids), temp=temp, top_k=top_k)
        while True:
            time.sleep(0.001)
            yield 7
    def create_completion(self, prompt, max_tokens, temperature):
        return {}
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.delenv(yardstick.ENV_PYTHON, raising=False)
    return lambda: [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_the_side_answers_each_command(fake):
    """Build first, then load / eval / round / serial / embed, each answer on its own line whatever
    llama.cpp prints; a command before load, or an unknown one, is answered with an error that the
    parent raises naming the interpreter. Mutations: round's decode loop taking one token more than
    decode_tokens, the build's system_info left out, or llama.cpp's stdout left on the answers'
    channel (the next answer is then not JSON), each fail it."""
    with LlamaCppSide(sys.executable) as side:
        assert side.build == dict(llama_cpp_python="0.0-fake", python=sys.executable, system_info="CPU : FAKE = 1")
        with pytest.raises(RuntimeError, match=rf"{sys.executable}.*'round' before load"):
            side.ask("round", prompt=[1], decode_prompt=[2], decode_tokens=3)
        assert side.ask("load", path="/m.gguf", n_ctx=256, threads=3, n_batch=64)["load_s"] > 0
        assert side.ask("eval", ids=[5, 6])["s"] > 0
        r = side.ask("round", prompt=[10, 11, 12], decode_prompt=[20, 21], decode_tokens=5)
        assert set(r) == {"prefill_tok_s", "ttft_s", "decode_tok_s", "tokens", "peak_rss_mb"} and r["tokens"] == 5
        assert 0 < r["decode_tok_s"] < 1 / 0.001 and r["prefill_tok_s"] < 3 / 0.001 and r["peak_rss_mb"] > 1
        s = side.ask("serial", prompts=[[1, 2], [3, 4, 5]], decode_tokens=4)
        assert s["counts"] == [4, 4] and len(s["ttft_s"]) == 2 and len(s["itl_s"]) == 6
        assert s["ttft_s"][1] > s["ttft_s"][0] + 3 * 0.001  # the second waited for the first
        side.ask("load", path="/e.gguf", n_ctx=2048, threads=1, n_batch=12, embedding=True, n_seq_max=32)
        assert side.ask("embed", inputs=[[1] * 5, [2] * 5, [3] * 5], batch=3, warm=False)["texts_s"] > 0
        with pytest.raises(RuntimeError, match="unknown command 'nap'"):
            side.ask("nap")
    calls = fake()
    assert calls[0] == dict(op="init", path="/m.gguf", n_ctx=256, threads=3, threads_batch=3)
    assert [c["ids"] for c in calls if c["op"] in ("eval", "generate")][:3] == [[5, 6], [10, 11, 12], [20, 21]]
    # the fake's file names no pooling: opened again with mean pooling, as hearthlm pools a decoder
    assert calls[-4:-2] == [dict(op="init", path="/e.gguf", n_ctx=2048, threads=1, threads_batch=1, embedding=True,
                                 n_ubatch=12, n_seq_max=32, **more) for more in ({}, dict(pooling_type=1))]
    assert [c["tokens"] for c in calls if c["op"] == "decode"] == [10, 5]  # n_batch 12: two texts, then one


def test_the_interpreter_is_named_or_refused(fake, monkeypatch, tmp_path):
    """--llama-cpp-python wins over $HEARTHLM_LLAMA_CPP_PYTHON; a named interpreter that is missing
    or cannot import llama_cpp is a one-line error naming it (never a silent fall back); with none
    named, this interpreter when it imports llama_cpp, else None. Mutation: interpreter() falling
    back to sys.executable when the named one fails fails it."""
    class A:
        llama_cpp_python = None
    a = A()
    assert interpreter(a) == sys.executable  # the fake imports here
    a.llama_cpp_python = str(tmp_path / "nope" / "python")
    with pytest.raises(InvalidRequestError, match=rf"^--llama-cpp-python {a.llama_cpp_python}: no such executable$"):
        interpreter(a)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    a.llama_cpp_python = str(bare / "bin" / "python")
    monkeypatch.delenv("PYTHONPATH")  # the venv's own site: no llama_cpp there
    with pytest.raises(InvalidRequestError, match=r"cannot import llama_cpp \(ModuleNotFoundError"):
        interpreter(a)
    a.llama_cpp_python = None
    monkeypatch.setenv(yardstick.ENV_PYTHON, str(bare / "bin" / "python"))
    with pytest.raises(InvalidRequestError, match=r"^\$HEARTHLM_LLAMA_CPP_PYTHON .*bare/bin/python: cannot import"):
        interpreter(a)
    monkeypatch.delenv(yardstick.ENV_PYTHON)
    assert interpreter(a) is None  # nothing named, and this interpreter has no llama_cpp now


def _bench(capsys, *args: str) -> str:
    from hearthlm.cli import build_parser
    a = build_parser().parse_args(["bench", *args])
    a.run(a)
    return "\n".join(ln for ln in capsys.readouterr().out.splitlines() if " [warning  ] " not in ln)


def test_single_stream_rounds_in_turn_and_the_report(fake, capsys, smollm2_path):
    """`bench --compare-llama-cpp --llama-cpp-python PY`: llama.cpp's rounds come from the child (the
    same prompts, `repeat` rounds after one warm-up), the ratio is hearthlm's over llama.cpp's, and
    the JSON names the CPU (/proc/cpuinfo), its ISA flags, the load average at start and end, and the
    build; the table prints the same. Mutations: the ratio taken llama.cpp / hearthlm, or the
    build not recorded in the report, each fail it."""
    common = ["--model", str(smollm2_path), "--compare-llama-cpp", "--llama-cpp-python", sys.executable,
              "--repeat", "2", "--prompt-tokens", "16", "--decode-tokens", "4", "--n-ctx", "256"]
    out = json.loads(_bench(capsys, *common, "--json"))
    ours, theirs, ratio = out["rows"][:3]
    assert (ours["engine"], theirs["engine"], ratio["engine"]) == ("hearthlm", "llama.cpp", "ratio")
    assert ratio["decode_tok_s"] == pytest.approx(ours["decode_tok_s"] / theirs["decode_tok_s"])
    assert out["llama_cpp"] == dict(llama_cpp_python="0.0-fake", python=sys.executable, system_info="CPU : FAKE = 1")
    cpu = yardstick.cpu_facts()
    assert out["host"] == cpu and cpu["cpu"] != "unknown CPU" and set(cpu["isa"]) <= set(yardstick.ISA)
    assert len(out["load_start"]) == len(out["load_end"]) == 3
    calls = fake()
    evals = [c["ids"] for c in calls if c["op"] == "eval"]
    assert len(evals) == 3 and all(len(e) == 16 for e in evals) and len({tuple(e) for e in evals}) == 3
    assert sum(c["op"] == "generate" for c in calls) == 2
    table = _bench(capsys, *common).splitlines()
    assert table[0].startswith(f"cpu: {cpu['cpu']}, ") and "load average" in table[0] and " at end" in table[0]
    head = table[:table.index(next(ln for ln in table if ln.startswith("model: ")))]
    assert any(ln.startswith("read bandwidth: ") for ln in head) and out["read_bandwidth_gb_s"] > 0
    assert f"llama.cpp: llama-cpp-python 0.0-fake in {sys.executable}: CPU : FAKE = 1" in head


def test_a_busy_host_is_called_so():
    """The header says when the 1-minute load reached the core count (llama.cpp's spinning OpenMP
    threads then slow it several times over). Mutation: the check reading the 15-minute load fails it."""
    host = dict(cpu="X", isa=["avx2"], cores=2)
    quiet = yardstick.header_lines(dict(host=host, load_start=[0.5, 3.0, 3.0], load_end=[1.2, 3.0, 3.0]))
    busy = yardstick.header_lines(dict(host=host, load_start=[0.5, 0.2, 0.1], load_end=[2.5, 0.5, 0.1]))
    assert quiet[0] == "cpu: X, 2 cores, avx2 (no amx)  load average 0.50/3.00/3.00 at start, 1.20/3.00/3.00 at end"
    assert len(quiet) == 1 and busy[1].startswith("busy host: 1-minute load 2.50 on 2 cores")


def test_concurrency_against_llama_cpps_serial_rate(fake, capsys, smollm2_path, monkeypatch):
    """--concurrency: --repeat rounds, each hearthlm's levels then llama.cpp's serial runs (n
    requests, decode_tokens each, distinct prompts); the rows are each figure's median over the
    rounds, then the ratio rows, each the median of the rounds' own ratios. Mutations seen to fail:
    serial's prompts all the first one's; llama.cpp's levels run once, after all of hearthlm's
    rounds; the ratio of the medians in place of the median of the rounds' ratios; the ratio taken
    llama.cpp / hearthlm."""
    from hearthlm.bench import speed
    seen = {"hearthlm": [], "llama.cpp": []}  # each round's rows, as the bench computed them
    ours, theirs = speed._hearthlm_level, speed._concurrency_llama_cpp

    async def our_level(s, a, n):
        row = await ours(s, a, n)
        seen["hearthlm"].append(row)
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
            f.write(json.dumps(dict(op="hearthlm", n=n)) + "\n")
        return row

    def their_levels(*args):
        rows = theirs(*args)
        seen["llama.cpp"] += rows
        return rows
    monkeypatch.setattr(speed, "_hearthlm_level", our_level)
    monkeypatch.setattr(speed, "_concurrency_llama_cpp", their_levels)
    out = json.loads(_bench(capsys, "--model", str(smollm2_path), "--compare-llama-cpp", "--llama-cpp-python",
                            sys.executable, "--concurrency", "1,3", "--decode-tokens", "3", "--n-ctx", "256",
                            "--repeat", "3", "--json"))
    engines = [(r["engine"], r["concurrency"]) for r in out["rows"]]
    assert engines == [("hearthlm", 1), ("hearthlm", 3), ("llama.cpp", 1), ("llama.cpp", 3), ("ratio", 1), ("ratio", 3)]
    assert out["rows"][3]["tokens"] == 9 and out["llama_cpp"]["llama_cpp_python"] == "0.0-fake"
    assert all(r["rounds"] == 3 for r in out["rows"])
    calls = [c for c in fake() if c["op"] in ("init", "hearthlm", "generate")]
    assert [c["op"] for c in calls].count("init") == 1
    order = [c["op"] if c["op"] != "generate" else "llama.cpp" for c in calls if c["op"] != "init"]
    assert order == (["hearthlm"] * 2 + ["llama.cpp"] * 4) * 3  # per round: hearthlm's levels, then llama.cpp's
    prompts = [tuple(c["ids"]) for c in calls if c["op"] == "generate"]
    assert len(set(prompts[1:4])) == 3 and prompts[4:8] == prompts[:4]
    for i, row in enumerate(out["rows"][4:]):
        h, r = seen["hearthlm"][i::2], seen["llama.cpp"][i::2]
        assert row["aggregate_tok_s"] == float(np.median([x["aggregate_tok_s"] / y["aggregate_tok_s"] for x, y in zip(h, r)]))
        assert out["rows"][i]["aggregate_tok_s"] == float(np.median([x["aggregate_tok_s"] for x in h]))


@pytest.mark.skipif(not Path(REAL).is_file(), reason=f"the shared llama-cpp-python build ({REAL}, or "
                    f"${yardstick.ENV_PYTHON}) is not on this machine")
def test_the_shared_build(smollm2_path):
    """The real llama-cpp-python in its own interpreter: its build named, a round on SmolLM2 timed."""
    with LlamaCppSide(REAL) as side:
        assert side.build["python"] == REAL and "AVX" in side.build["system_info"]
        assert side.build["llama_cpp_python"].count(".") == 2
        side.ask("load", path=str(smollm2_path), n_ctx=256, threads=1, n_batch=64)
        r = side.ask("round", prompt=list(range(1000, 1016)), decode_prompt=list(range(2000, 2008)), decode_tokens=4)
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_rss_mb"] > 50
