"""Quantized KV caches (Session.open(kv_cache_type="q8_0" | "q4_0"), core.kv_types): ggml's
blocks of 32 values along head_dim, as llama.cpp's -ctk/-ctv store them. The oracle is gguf.quants
(ggml's quantize_row_*_ref and dequantize_row_*): the reference backend's writes are its bytes and
its attention over a quantized cache is float attention over gguf's dequantized one; each backend's
cache writes (SET_ROWS, ROPE_SET_ROWS) and reads (ATTN, the unfused GATHER_KV chain, an encoder's
whole-sequence attention) against the reference, at the real models' head dims with GQA, several
sequences over scattered blocks and chunk boundaries. Then the engine on tiny models: bytes per
token, fused == unfused, close to f16, persisted prefixes keyed by the type, clear refusals, the
CLI and server flags; the cuda kernels' launches (without a GPU) and their block code on the host."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from hearthlm import Session
from hearthlm.backends.cuda.modules import KERNEL_DIR
from hearthlm.core import kv_types
from hearthlm.core.errors import InvalidRequestError
from hearthlm.core.graph import Graph, Op
from test_backend_ops import BS, BT, GQA, N_BLOCKS, REF, backend, f32, inputs, nmse, rng_for, scenario  # noqa: F401
from test_cuda_launch import fake_ops  # noqa: F401
from tiny_gguf import write_tiny

QT = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}
STORE = {"q8_0": np.int8, "q4_0": np.uint8}


def quantize(x: np.ndarray, kv: str) -> np.ndarray:
    """x (n, h, d) as a quantized cache's rows: gguf's bytes in the cache's dtype."""
    return quants.quantize(x, QT[kv]).view(STORE[kv])


def values(cache: np.ndarray, kv: str) -> np.ndarray:
    return quants.dequantize(np.ascontiguousarray(cache).view(np.uint8), QT[kv])


def run(be, g: Graph, feed, caches, out_buffers: bool = False):
    """The graph's kernels one by one on `be`; caches (quantized numpy arrays) are copied in.
    Returns (outputs, caches as left) as numpy arrays."""
    vals, live = {}, {}
    for node in g.nodes:
        if node.op is Op.INPUT:
            v = be.from_host(np.array(feed[node.name]))
        elif node.op is Op.CACHE:
            v = live[node.name] = be.from_host(caches[node.name].copy())
        else:
            srcs = [vals[id(s)] for s in node.srcs]
            if out_buffers and not (node.op.props.view or node.op.props.writes_cache):
                v = be.bind(node)(*srcs, out=np.full(node.shape, np.nan, np.float32))
            else:
                v = be.bind(node)(*srcs)
            if not node.op.props.writes_cache:
                assert tuple(v.shape) == node.shape, (node.label, v.shape, node.shape)
        vals[id(node)] = v
    outs = [np.asarray(be.to_host(vals[id(o)])) for o in g.outputs]
    return outs, {k: np.asarray(be.to_host(c)) for k, c in live.items()}


# ---- cases ----

def kv_write(kv, fused, n_kv, d, scen):
    seq, pos, slots = scenario(scen)
    rng = rng_for("kvq-write", kv, fused, n_kv, d, scen)
    cache = quantize(f32(rng, N_BLOCKS * BS, n_kv, d), kv)
    x = f32(rng, len(seq), n_kv, d, scale=2.0)
    x[:1, :1, :32] = 0  # an all-zero block: scale 0
    g = Graph()
    c = g.cache("cache_k", (N_BLOCKS * BS, n_kv, d), 0)
    xi, pi, si = inputs(g, x=x, pos=pos, slots=slots)
    g.outputs.append(g.rope_set_rows(c, xi, pi, si, name="kw", n_rot=d, base=1e4, freq_scale=1.0, neox=True)
                     if fused else g.set_rows(c, xi, si, "kw"))
    return g, {"x": x, "pos": pos, "slots": slots}, {"cache_k": cache}


def attention(kv, part, shape, scen, window=0, softcap=0.0, causal=True):
    n_head, n_kv, d = shape
    seq, pos, _ = scenario(scen)
    rng = rng_for("kvq-attn", kv, part, shape, scen, window, causal)
    kc = quantize(f32(rng, N_BLOCKS * BS, n_kv, d), kv)
    vc = quantize(f32(rng, N_BLOCKS * BS, n_kv, d), kv)
    last = {int(s): int(pos[seq == s].max()) for s in set(seq.tolist())}
    feed = {"q": f32(rng, len(seq), n_head, d), "seq": seq, "pos": pos, "bt": BT}
    if not causal:
        feed["sl"] = np.array([last[int(s)] + 1 for s in seq], np.int32)
    g = Graph()
    q, sq, ps, bt, *sl = inputs(g, **feed)
    sl = sl[0] if sl else None
    kci, vci = g.cache("cache_k", (N_BLOCKS * BS, n_kv, d), 0), g.cache("cache_v", (N_BLOCKS * BS, n_kv, d), 0)
    if part == "attn":
        g.outputs.append(g.attn(q, kci, vci, sq, ps, bt, scale=d ** -0.5, block_size=BS, window=window,
                                softcap=softcap, seq_len=sl, name="a"))
    else:  # the unfused chain: K/V gathered (dequantized) through the block table
        k = g.gather_kv(kci, bt, block_size=BS, name="k")
        s = g.scale(g.kq(q, k, sq, "kq"), d ** -0.5, "kq_scaled")
        mask = g.kq_mask(ps, n_kv=k.shape[1], window=window, seq_len=sl, name="mask")
        probs = g.soft_max(g.add(s, mask, "kq_masked"), "probs")
        g.outputs.append(g.kqv(probs, g.gather_kv(vci, bt, block_size=BS, name="v"), sq, "kqv"))
    return g, feed, {"cache_k": kc, "cache_v": vc}


KVS = list(QT)
WRITES = [pytest.param(kv, f, n_kv, d, s, id=f"{kv}-{'rope' if f else 'set'}-{n_kv}x{d}-{s}")
          for kv in KVS for f in (False, True) for _, n_kv, d in GQA for s in ("empty", "decode", "chunk", "prefill")]
ATTNS = [pytest.param(kv, "attn", sh, s, w, id=f"{kv}-attn-{'x'.join(map(str, sh))}-{s}-w{w}")
         for kv in KVS for sh in GQA for s in ("empty", "decode", "chunk", "prefill") for w in (0, 8)]
ATTNS += [pytest.param(kv, "unfused", sh, s, 0, id=f"{kv}-unfused-{'x'.join(map(str, sh))}-{s}")
          for kv in KVS for sh in GQA[:2] for s in ("decode", "chunk", "prefill")]


def _check_write(got: np.ndarray, want: np.ndarray, kv: str, exact: bool) -> None:
    """Bit for bit (set_rows); after RoPE (float32 on the backend, float64 in the reference) a
    code may sit one step over where a value lands on a rounding boundary, nothing more."""
    if exact:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        return
    a, b = values(got, kv), values(want, kv)
    step = np.abs(values(want, kv)).max() / (8 if kv == "q4_0" else 127) + 1e-30
    off = np.abs(a - b) > 1e-6 * step
    assert off.mean() < 1e-3 and nmse(a, b) < 1e-6, (off.sum(), nmse(a, b))


def test_reference_is_gguf_quants():
    """The reference's writes are gguf.quants' bytes at the slots (others untouched), and its
    attention over a quantized cache is float attention over the dequantized cache."""
    for kv in KVS:
        g, feed, caches = kv_write(kv, False, 2, 64, "chunk")
        _, after = run(REF, g, feed, caches)
        slots = feed["slots"]
        want = caches["cache_k"].copy()
        want[slots] = quantize(feed["x"], kv)
        assert np.array_equal(after["cache_k"], want)
        g, feed, caches = attention(kv, "attn", GQA[0], "chunk", window=8)
        (got,), _ = run(REF, g, feed, caches)
        floats = {k: values(c, kv) for k, c in caches.items()}
        node = g.outputs[0]
        oracle = REF.kernels[Op.ATTN](node, *(floats[s.name] if s.op is Op.CACHE else feed[s.name] for s in node.srcs))
        assert nmse(got, oracle) < 1e-12


@pytest.mark.parametrize("kv,fused,n_kv,d,scen", WRITES)
def test_cache_writes(backend, kv, fused, n_kv, d, scen):
    g, feed, caches = kv_write(kv, fused, n_kv, d, scen)
    _, want = run(REF, g, feed, caches)
    _, got = run(backend, g, feed, caches)
    _check_write(got["cache_k"], want["cache_k"], kv, exact=not fused)


@pytest.mark.parametrize("kv,part,shape,scen,window", ATTNS)
def test_attention_reads_blocks(backend, kv, part, shape, scen, window):
    if backend.name == "cuda" and shape[2] > 256:
        pytest.skip("head dim over the cuda kernel's")
    g, feed, caches = attention(kv, part, shape, scen, window)
    (want,), _ = run(REF, g, feed, caches)
    for out_buffers in (False, True) if backend.plans_memory else (False,):
        (got,), _ = run(backend, g, feed, caches, out_buffers)
        masked = np.isinf(want)
        assert np.array_equal(got[masked], want[masked])
        assert nmse(got[~masked], want[~masked]) < 5e-4


@pytest.mark.parametrize("kv", KVS)
def test_encoder_and_softcap_attention(backend, kv):
    """Non-causal attention over whole inputs (the CPU's batched-product path), and soft-capped scores."""
    for args in ((GQA[0], "encode", 0, 0.0, False), (GQA[1], "prefill", 0, 0.0, False), (GQA[0], "chunk", 8, 1.5)):
        shape, scen, window, softcap, *causal = args
        g, feed, caches = attention(kv, "attn", shape, scen, window, softcap, *causal)
        (want,), _ = run(REF, g, feed, caches)
        (got,), _ = run(backend, g, feed, caches)
        assert nmse(got, want) < 5e-4, args


# ---- the engine on tiny models ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:  # head_dim 32
    return str(write_tiny(tmp_path_factory.mktemp("kvq") / "tiny.gguf", n_embd=128, n_head=4, n_head_kv=2,
                          n_layer=2))


PROMPT = list(range(3, 200))  # 197 tokens: 13 blocks of 16, attention across many of them


async def first_step(model, **kw):
    async with Session.open(model, n_ctx=512, weight_cache=False, prompt_cache=False, **kw) as s:
        c = await s.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=5)
        return c.token_ids, dict(c.top_logprobs[0]), s.stats()


async def test_engine_bytes_per_token_and_accuracy(tiny):
    ids16, lp16, st16 = await first_step(tiny)
    ids8, lp8, st8 = await first_step(tiny, kv_cache_type="q8_0")
    ids8u, lp8u, _ = await first_step(tiny, kv_cache_type="q8_0", fusion=False)
    _, lp4, st4 = await first_step(tiny, kv_cache_type="q4_0")
    # per token: 2 layers x K and V x 2 heads x 32 values, at 2 bytes; 34 and 18 bytes per 32
    assert (st16["kv_bytes_per_token"], st8["kv_bytes_per_token"], st4["kv_bytes_per_token"]) == (512, 272, 144)
    assert st8["kv_cache_type"] == "q8_0" and st8["kv_cache_bytes"] == st16["kv_cache_bytes"] * 34 // 64
    # fused == unfused: the two attention paths agree to ~1e-7 (the op suite), but the next layer's
    # int8 activations can round such a difference to ~1e-3 of this peaked tiny model's logits (-60:
    # the AVX-512 kernels sum in another order than the AVX2 ones, where they came out bitwise equal)
    assert ids8u == ids8 and all(abs(lp8u[t] - lp8[t]) <= 1e-2 * abs(lp8[t]) + 1e-4 for t in lp8)
    top = max(lp16, key=lp16.get)
    assert abs(lp8[top] - lp16[top]) < 0.02 and abs(lp4[top] - lp16[top]) < 0.2


async def test_refusals(tmp_path, tiny):
    with pytest.raises(InvalidRequestError, match="f16, q8_0, q4_0"):
        async with Session.open(tiny, kv_cache_type="q8"):
            pass
    odd = str(write_tiny(tmp_path / "hd16.gguf"))  # head_dim 16
    with pytest.raises(InvalidRequestError, match="head_dim is 16"):
        async with Session.open(odd, kv_cache_type="q4_0", weight_cache=False):
            pass
    async with Session.open(odd, weight_cache=False) as s:  # f16 takes any head_dim
        assert s.stats()["kv_cache_type"] == "f16"


async def test_persisted_prefixes_keyed_by_type(tiny, tmp_path):
    """A q8_0 session's prefix file serves a later q8_0 session (same answer as computing it) and
    never an f16 one (another key): their files do not mix."""
    async def ask(kv, **kw):
        async with Session.open(tiny, n_ctx=512, weight_cache=False, prompt_cache_dir=tmp_path,
                                kv_cache_type=kv, **kw) as s:
            c = await s.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=1)
            return c.token_ids, [t[0][1] for t in c.top_logprobs], s.stats()
    ref = await ask("q8_0", prompt_cache=False)
    async with Session.open(tiny, n_ctx=512, weight_cache=False, prompt_cache_dir=tmp_path, kv_cache_type="q8_0") as s:
        assert await s.cache_prefix(PROMPT[:160]) == 160
    ids, lps, st = await ask("q8_0")
    assert st["prompt_cache_loaded_tokens"] == 160 and ids == ref[0] and lps == pytest.approx(ref[1], abs=1e-5)
    assert (await ask("f16"))[2]["prompt_cache_loaded_tokens"] == 0
    assert (await ask("q4_0"))[2]["prompt_cache_loaded_tokens"] == 0


async def test_encoder_embeds_with_a_quantized_cache(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "parity"))
    from encoders import HP, TEXTS, _write_bert
    path = str(_write_bert(tmp_path / "bert.gguf", "bert", 1, True, False, 0,
                           hp={**HP, "embedding_length": 64, "attention.head_count": 2}))  # head_dim 32
    embs = {}
    for kv in ("f16", "q8_0"):
        async with Session.open(path, weight_cache=False, kv_cache_type=kv) as s:
            embs[kv] = np.asarray(await s.embed(TEXTS), np.float64)
    cos = (embs["f16"] * embs["q8_0"]).sum(1) / np.linalg.norm(embs["f16"], axis=1) / np.linalg.norm(embs["q8_0"], axis=1)
    assert cos.min() > 0.999


def test_cli_and_server_take_the_type(tiny, capsys, monkeypatch):
    from hearthlm import cli
    assert cli.main(["generate", "t t", "--model", tiny, "--max-tokens", "3", "--kv-cache-type", "q8_0"]) == 0
    assert cli.main(["generate", "t t", "--model", tiny, "--kv-cache-type", "q5_1"]) == 1
    assert "q8_0, q4_0" in capsys.readouterr().err
    pytest.importorskip("uvicorn")
    import uvicorn

    from hearthlm.serve import app, server
    seen = {}
    monkeypatch.setattr(app, "build_app", lambda models, **kw: seen.update(kw))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    import argparse
    p = argparse.ArgumentParser()
    server.add_serve_args(p)
    server.run_serve(p.parse_args([tiny, "--kv-cache-type", "q4_0"]))
    assert seen["kv_cache_type"] == "q4_0"


# ---- cuda: launches without a GPU, the block code on the host ----

def test_cuda_launches(fake_ops):
    """Each cache op's kernel of the quantized type, its arguments fitting the .cu signature
    (test_cuda_launch's checker), results shaped as the node; none on an empty batch."""
    ops, cp, launches = fake_ops
    for kv in KVS:
        for build, kw in ((kv_write, dict(fused=False, n_kv=2, d=64, scen="chunk")),
                          (kv_write, dict(fused=True, n_kv=2, d=64, scen="chunk")),
                          (kv_write, dict(fused=True, n_kv=2, d=64, scen="empty")),
                          (attention, dict(part="attn", shape=GQA[3], scen="chunk")),
                          (attention, dict(part="attn", shape=GQA[3], scen="empty")),
                          (attention, dict(part="unfused", shape=GQA[0], scen="decode"))):
            launches.clear()
            g, feed, caches = build(kv, **kw)
            for node in g.nodes:  # only the ops that touch the cache: the rest are float as before
                if node.op in (Op.SET_ROWS, Op.ROPE_SET_ROWS, Op.ATTN, Op.GATHER_KV):
                    srcs = [caches[s.name].copy() if s.op is Op.CACHE else np.array(feed[s.name])
                            for s in node.srcs]
                    y = ops.KERNELS[node.op](node, *srcs)
                    assert node.op.props.writes_cache or y.shape == node.shape
            fns = {fn for fn, _ in launches}
            want = {"set_rows": {f"kv_store_{kv}"}, "attn": {f"attn_paged_{kv}"},
                    "unfused": {f"kv_dequant_{kv}"}}[kw.get("part", "set_rows")]
            assert (not fns) if kw["scen"] == "empty" else want <= fns, (kw, fns)


_HARNESS = r"""
#include <math.h>
#include "kv_quants.cuh"
template <int T> void q(const float* x, int n_blocks, u8* out) {
    for (int b = 0; b < n_blocks; ++b) kv_quantize<T>(x + 32 * b, out + b * KVBlock<T>::bytes);
}
template <int T> void v(const u8* blocks, int n_blocks, float* out) {
    for (int b = 0; b < n_blocks; ++b)
        for (int j = 0; j < 32; ++j) out[32 * b + j] = kv_value<T>(blocks + b * KVBlock<T>::bytes, j);
}
extern "C" void host_quantize(int t, const float* x, int n, u8* out) { t == 8 ? q<KV_Q8_0>(x, n, out) : q<KV_Q4_0>(x, n, out); }
extern "C" void host_values(int t, const u8* b, int n, float* out) { t == 8 ? v<KV_Q8_0>(b, n, out) : v<KV_Q4_0>(b, n, out); }
extern "C" unsigned short host_f2h(float f) { return f2h(f); }
"""


def test_cuda_block_code_on_host(tmp_path):
    """kv_quants.cuh, built as plain C++: its quantization is gguf's byte for byte, its reads gguf's
    dequantization, its float -> half rounding numpy's (the GPU uses cvt.rn there)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "h.cpp").write_text(_HARNESS)
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{KERNEL_DIR}", "h.cpp",
                        "-o", "h.so"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    lib = ctypes.CDLL(str(tmp_path / "h.so"))
    lib.host_f2h.restype, lib.host_f2h.argtypes = ctypes.c_uint16, [ctypes.c_float]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 32)) * rng.uniform(1e-6, 1e3, (64, 1))).astype(np.float32)
    x[0] = 0
    P = ctypes.c_void_p
    for kv in KVS:
        want = quants.quantize(x, QT[kv])
        got = np.zeros_like(want)
        lib.host_quantize(int(QT[kv]), x.ctypes.data_as(P), 64, got.ctypes.data_as(P))
        assert np.array_equal(got, want), kv
        vals = np.zeros((64, 32), np.float32)
        lib.host_values(int(QT[kv]), want.ctypes.data_as(P), 64, vals.ctypes.data_as(P))
        assert np.array_equal(vals, quants.dequantize(want, QT[kv])), kv
    f = np.concatenate([rng.standard_normal(2000) * s for s in (1e-7, 1e-5, 1, 1e4)]).astype(np.float32)
    f = np.concatenate([f, np.float32([0, 6e-8, 3e-8, 65504, 65519, 65520, 1e6, np.inf, -np.inf])])
    with np.errstate(over="ignore"):
        assert [lib.host_f2h(float(v)) for v in f] == list(f.astype(np.float16).view(np.uint16))


def test_kv_types_layout():
    assert kv_types.storage("q8_0", np.float16, 2, 64) == ((2, 68), np.dtype(np.int8))
    assert kv_types.storage("q4_0", np.float16, 2, 256) == ((2, 144), np.dtype(np.uint8))
    assert kv_types.storage("f16", np.float32, 2, 64) == ((2, 64), np.dtype(np.float32))
    c = np.zeros((4, 2, 68), np.int8)
    assert (kv_types.quant_of(c), kv_types.head_dim(c), kv_types.name_of(c)) == ("q8_0", 64, "q8_0")
    assert kv_types.name_of(np.zeros(1, np.float16)) == "<f2"  # an f16 prompt cache key as before
    assert kv_types.check("q8_0", [(0, 0), (2, 48)]) and not kv_types.check("q8_0", [(0, 0), (2, 64)])
