"""Generation parity and decode speed of the cuda backend against the cpu backend, on tiny
GGUFs written on the spot (the GPU machine cannot take real models along): the real models'
layer shapes with a few layers, random weights, every weight type. Used by tests/gpu_check.sh:
    python tests/gpu_parity.py models DIR               write the parity models
    python tests/gpu_parity.py parity DIR [--backend B] compare B (default cuda) with cpu
    python tests/gpu_parity.py bench DIR [--backend B]  decode tok/s, B (default cuda) and cpu
    python tests/gpu_parity.py graphs DIR               decoding replayed as CUDA graphs = eager
    python tests/gpu_parity.py speed DIR [--backend B]  #25's figures on B alone: a Qwen2.5-0.5B
                                                        shape, 1 and 16 streams, prefill 512
Parity is an NMSE of logits, not equal tokens: the GPU quantizes activations differently
(q8_1 blocks, in another order), so near-ties may flip a greedy token. Through the public API:
each prefix of one prompt is a request for one token with top_logprobs=20, so both backends
give their logprobs at the same positions; logprobs are logits less a constant per row, so
the rows are centered over the ids both top-20s hold and compared. `--backend reference`
runs the same harness where there is no GPU."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from hearthlm import Session
from hearthlm.model_zoo.tokenizer_bpe import _byte_to_unicode

# the layer shapes of the models the project serves; qwen2.5 runs as a llama stand-in (no
# q/k/v biases) until its architecture lands. gemma3's window is 8, not 512, so the 24-token
# prompts cross it.
SHAPES = {
    "smollm2": dict(arch="llama", n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536, n_layer=2),
    "gemma3": dict(arch="gemma3", n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048, n_layer=6, window=8),
    "qwen2.5": dict(arch="llama", n_embd=896, n_head=14, n_head_kv=2, head_dim=64, n_ff=4864, n_layer=2),
}
FLOATS = [T.F32, T.F16, T.BF16]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = FLOATS + [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0] + KQUANTS
PARITY = [("smollm2", t) for t in ALL_TYPES] + [("gemma3", T.Q8_0), ("gemma3", T.Q4_K), ("qwen2.5", T.Q8_0),
                                                 ("qwen2.5", T.Q4_0)]
OFFLOAD = {("smollm2", T.Q4_K): 1, ("gemma3", T.Q8_0): 3, ("qwen2.5", T.Q8_0): 1}  # n_gpu_layers
# centered-logit NMSE bounds. Both the cpu (since stop 17) and the GPU quantize activations to
# int8 per 32 for quantized weights (q8_0 / q8_1), noise like 8-bit weights': on the cpu, Q8_0
# vs F16 weights of one model give 2e-5 (Q5_0 vs Q8_0 8e-4, Q4_0 vs Q8_0 3e-3), hence 2e-4
TOL = {"float": 1e-5, "quant": 2e-4}
PREFIXES = [1, 2, 7, 8, 9, 16, 17, 24]  # one token, around mmvq's 8, around the 16-token chunks
KQ_F16 = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # d (and dmin)


def _vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    table = _byte_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [table[b] for b in range(256)] + [table[32] + "t"]
    tokens += [f"x{i}" for i in range(n_vocab - len(tokens))]  # unreachable by merges: ids only
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3)


def _matrix(rng, rows: int, cols: int, qtype: T, scale: float):
    """GGUF bytes of a (rows, cols) matrix ~ N(0, scale): the type, or Q8_0 where the type's block
    does not divide a row (as llama.cpp falls back; 576, 640 and 896 are no K-quant rows)."""
    qtype = qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else T.Q8_0
    if qtype in KQUANTS:  # gguf cannot quantize K-quants: random blocks, scales set for the spread
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)

        def set_scales(v):
            for off in KQ_F16[qtype]:
                raw[:, off:off + 2] = np.full((len(raw), 1), v, np.float16).view(np.uint8)
        set_scales(1.0)
        set_scales(scale / quants.dequantize(raw.reshape(rows, -1), qtype).std())
        return raw.reshape(rows, -1), qtype
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    return (x if qtype == T.F32 else quants.quantize(x, qtype)), qtype


def write_model(path: Path, shape: str, qtype: T, *, n_layer: int | None = None, n_vocab: int = 260,
                seed: int = 0) -> Path:
    s = SHAPES[shape]
    arch, e, hd, ff = s["arch"], s["n_embd"], s["head_dim"], s["n_ff"]
    n_layer = n_layer or s["n_layer"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(e)
    w.add_feed_forward_length(ff)
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    if "window" in s:
        w.add_sliding_window(s["window"])
    tokens, types = _vocab(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{_byte_to_unicode()[32]} t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def mat(name, rows, cols, scale=None):
        data, t = _matrix(rng, rows, cols, qtype, scale or cols ** -0.5)
        w.add_tensor(name, data, raw_dtype=t)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", len(tokens), e, scale=1.0)  # tied: also the output head
    vec("output_norm.weight", e)
    q, kv = s["n_head"] * hd, s["n_head_kv"] * hd
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", e)
        mat(p + "attn_q.weight", q, e)
        mat(p + "attn_k.weight", kv, e)
        mat(p + "attn_v.weight", kv, e)
        mat(p + "attn_output.weight", e, q)
        vec(p + "ffn_norm.weight", e)
        mat(p + "ffn_gate.weight", ff, e)
        mat(p + "ffn_up.weight", ff, e)
        mat(p + "ffn_down.weight", e, ff)
        if arch == "gemma3":
            for n, size in (("attn_q_norm", hd), ("attn_k_norm", hd), ("post_attention_norm", e),
                            ("post_ffw_norm", e)):
                vec(p + n + ".weight", size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_path(d: Path, shape: str, qtype: T) -> Path:
    return d / f"{shape}-{qtype.name.lower()}.gguf"


async def top_rows(path: Path, prompt: list[int], **open_kw) -> list[dict[int, float]]:
    """Top-20 logprobs after each prefix of `prompt`, all prefixes in flight at once (prefill
    chunks of 16 tokens, so most chunks want no logits)."""
    async with Session.open(str(path), n_ctx=256, max_batch_tokens=16, **open_kw) as s:
        outs = await asyncio.gather(*(s.generate(prompt[:m], max_tokens=1, temperature=0, top_logprobs=20)
                                      for m in PREFIXES))
    return [dict(c.top_logprobs[0]) for c in outs]


def compare(ref: list[dict[int, float]], got: list[dict[int, float]]) -> tuple[float, int]:
    """(NMSE of the centered logits over the ids both rows hold, the fewest such ids in a row)."""
    num = den = 0.0
    fewest = 20
    for r, g in zip(ref, got):
        ids = [i for i in r if i in g]
        fewest = min(fewest, len(ids))
        a, b = np.array([g[i] for i in ids]), np.array([r[i] for i in ids])
        a, b = a - a.mean(), b - b.mean()
        num, den = num + ((a - b) ** 2).sum(), den + (b ** 2).sum()
    return num / max(den, 1e-30), fewest


async def parity(d: Path, backend: str) -> int:
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 259, max(PREFIXES))]
    failed = []
    for shape, qtype in PARITY:
        path = model_path(d, shape, qtype)
        sides = [(backend, dict(backend=backend))]
        if backend == "cuda" and (shape, qtype) in OFFLOAD:
            k = OFFLOAD[(shape, qtype)]
            sides.append((f"cuda ngl={k}", dict(device="cuda", n_gpu_layers=k)))
        tol = TOL["float" if qtype in FLOATS else "quant"]
        try:
            ref = await top_rows(path, prompt, backend="cpu")
        except Exception as e:  # one broken case must not hide the others
            failed.append(f"{path.name} cpu")
            print(f"{path.name:<20} cpu            ERROR {type(e).__name__}: {e}", flush=True)
            continue
        for side, kw in sides:
            t0 = time.perf_counter()
            try:
                err, fewest = compare(ref, await top_rows(path, prompt, **kw))
            except Exception as e:
                failed.append(f"{path.name} {side}")
                print(f"{path.name:<20} {side:<14} ERROR {type(e).__name__}: {e}", flush=True)
                continue
            ok = err < tol and fewest >= 15
            print(f"{path.name:<20} {side:<14} nmse {err:.2e} (< {tol:.0e})  top-20 shared >= {fewest:>2}  "
                  f"{time.perf_counter() - t0:5.1f}s  {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                failed.append(f"{path.name} {side}")
    n = sum(1 + (backend == "cuda" and k in OFFLOAD) for k in PARITY)
    print(f"parity: {n - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


async def bench(d: Path, backend: str) -> int:
    """Decode tok/s of a SmolLM2-135M-shaped model at full depth (30 layers, 49152 tokens, Q8_0),
    single stream after a warm-up, on `backend` and cpu."""
    path = d / "smollm2-full-q8_0.gguf"
    if not path.exists():
        t = time.perf_counter()
        write_model(path, "smollm2", T.Q8_0, n_layer=30, n_vocab=49152)
        print(f"wrote {path.name} ({path.stat().st_size >> 20} MiB) in {time.perf_counter() - t:.0f}s")
    rng = np.random.default_rng(2)
    rates = {}
    for side in (backend, "cpu"):
        async with Session.open(str(path), backend=side, n_ctx=512) as s:
            await s.generate([int(t) for t in rng.integers(300, 49152, 128)], max_tokens=2, temperature=0)
            prompt = [int(t) for t in rng.integers(300, 49152, 128)]
            t = time.perf_counter()
            await s.generate(prompt, max_tokens=1, temperature=0)
            prefill = 128 / (time.perf_counter() - t)
            first, n = None, 0  # timed from the first token: decode steps only
            async for c in s.stream(prompt[:8], max_tokens=65, temperature=0, ignore_eos=True):
                if first is None:
                    first = time.perf_counter()
                else:
                    n += len(c.token_ids)
            rates[side] = n / (time.perf_counter() - first)
            print(f"{side:<9} prefill {prefill:7.0f} tok/s (128 tokens)  decode {rates[side]:6.1f} tok/s "
                  f"({n} tokens)", flush=True)
    print(f"decode tok/s: {backend} {rates[backend]:.1f}, cpu {rates['cpu']:.1f} "
          f"({backend}/cpu {rates[backend] / rates['cpu']:.2f})")
    return 0


GRAPH_CASES = [("smollm2", T.Q4_K), ("smollm2", T.F16), ("gemma3", T.Q8_0), ("qwen2.5", T.Q4_0)]


async def _decode_all(path: Path, groups: list[list[list[int]]], backend: str) -> tuple[list, dict]:
    """Greedy tokens and top-5 logprobs of each prompt, a group's prompts in flight at once, group
    after group; and the graph replays' counters summed."""
    got = []
    async with Session.open(str(path), backend=backend, n_ctx=256, max_seqs=16) as s:
        for prompts in groups:
            got += await asyncio.gather(*(s.generate(p, max_tokens=24, temperature=0, top_logprobs=5,
                                                     ignore_eos=True) for p in prompts))
        counts = {"captures": 0, "replays": 0}
        for entry in s.engine.graphs._graphs.values():
            r = entry.compiled.runner
            for k in counts:
                counts[k] += r.counters[k] if r is not None else 0
    return [(c.token_ids, c.top_logprobs) for c in got], counts


async def graphs_parity(d: Path, backend: str) -> int:
    """Decoding with CUDA graphs (1, 3 and 12 streams) against the same session shape without:
    the same kernels on the same inputs, so the same tokens and logprobs."""
    import os
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 259, n)] for n in (5, 11, 17, *range(6, 18))]
    groups = [prompts[:3], prompts[3:], prompts[:1]]  # 3 streams (a step of 4 tokens), 12 (16), then 1
    failed = []
    for shape, qtype in GRAPH_CASES:
        path = model_path(d, shape, qtype)
        os.environ["HEARTHLM_CUDA_GRAPHS"] = "0"
        want, off = await _decode_all(path, groups, backend)
        os.environ["HEARTHLM_CUDA_GRAPHS"] = "1"
        t = time.perf_counter()
        got, on = await _decode_all(path, groups, backend)
        same_tokens = [g[0] for g in got] == [w[0] for w in want]
        diff = max((abs(a - b) for g, w in zip(got, want) for rg, rw in zip(g[1], w[1])
                    for (ia, a), (ib, b) in zip(rg, rw) if ia == ib), default=0.0)
        # float weights go to cuBLAS, which CuPy cannot capture: those graphs stay eager
        ok = (same_tokens and diff <= 1e-4 and off["replays"] == 0
              and (on["replays"] >= 50 if qtype not in FLOATS else on["captures"] == 0))
        print(f"{path.name:<20} graphs: tokens {'same' if same_tokens else 'DIFFER'}, logprobs within {diff:.1e}, "
              f"{on['captures']} captures, {on['replays']} replays (eager: {off['replays']})  "
              f"{time.perf_counter() - t:5.1f}s  {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            failed.append(path.name)
    print(f"graphs: {len(GRAPH_CASES) - len(failed)} passed, {len(failed)} failed" +
          (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


async def speed(d: Path, backend: str) -> int:
    """A Qwen2.5-0.5B-shaped model (24 layers, 151936 tokens) in Q4_K where rows allow, Q8_0
    elsewhere (as llama.cpp falls back on 896-wide rows): decode of 1 stream, of 16 streams
    together, and a 512-token prefill, on `backend` alone."""
    path = d / "qwen2.5-full-q4_k.gguf"
    if not path.exists():
        t = time.perf_counter()
        write_model(path, "qwen2.5", T.Q4_K, n_layer=24, n_vocab=151936)
        print(f"wrote {path.name} ({path.stat().st_size >> 20} MiB) in {time.perf_counter() - t:.0f}s", flush=True)
    rng = np.random.default_rng(3)
    toks = lambda n: [int(t) for t in rng.integers(300, 151936, n)]
    async with Session.open(str(path), backend=backend, n_ctx=1024, max_batch_tokens=512, max_seqs=16) as ses:
        await ses.generate(toks(512), max_tokens=2, temperature=0)  # compile and warm every shape
        await asyncio.gather(*(ses.generate(toks(8), max_tokens=4, temperature=0) for _ in range(16)))
        t = time.perf_counter()
        await ses.generate(toks(512), max_tokens=1, temperature=0)
        prefill = 512 / (time.perf_counter() - t)

        async def decode(prompt, n):  # tokens after the first, and when the first came
            first, got = None, 0
            async for c in ses.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True):
                if first is None:
                    first = time.perf_counter()
                else:
                    got += len(c.token_ids)
            return first, got, time.perf_counter()
        _f, _g, _e = await decode(toks(8), 4)
        first, got, end = await decode(toks(8), 129)
        one = got / (end - first)
        runs = await asyncio.gather(*(decode(toks(8), 129) for _ in range(16)))
        start, stop = max(r[0] for r in runs), min(r[2] for r in runs)  # all 16 decoding
        # tokens in [start, stop], from each stream's own mean rate
        many = sum(r[1] / (r[2] - r[0]) for r in runs) if stop > start else float("nan")
    print(f"speed {backend} qwen2.5-0.5B shape q4_k: prefill 512 {prefill:7.0f} tok/s | decode 1 stream "
          f"{one:6.1f} tok/s | 16 streams {many:7.1f} tok/s ({many / one:.1f}x one stream)", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["models", "parity", "bench", "speed", "graphs"])
    p.add_argument("dir", type=Path)
    p.add_argument("--backend", default="cuda", help="the backend measured against cpu")
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.cmd == "models":
        t = time.perf_counter()
        for shape, qtype in PARITY:
            write_model(model_path(a.dir, shape, qtype), shape, qtype)
        size = sum(model_path(a.dir, *k).stat().st_size for k in PARITY)
        print(f"wrote {len(PARITY)} models ({size >> 20} MiB) in {time.perf_counter() - t:.1f}s to {a.dir}")
        return 0
    run = {"parity": parity, "bench": bench, "speed": speed, "graphs": graphs_parity}[a.cmd]
    return asyncio.run(run(a.dir, a.backend))


if __name__ == "__main__":
    sys.exit(main())
