"""KV cache types (Session.open(kv_cache_type=...), core.kv_types): a registry of llama.cpp's
-ctk/-ctv types by name, ggml's blocks of 32 values along head_dim, and "+rot", its Hadamard
rotation of K/V. The oracles: gguf.quants (ggml's quantize_row_*_ref and dequantize_row_*), and
ggml's own bytes for each type (tests/data/kv_blocks.npz, recorded from llama.cpp's libggml: gguf
has no iq4_nl quantization). The reference backend's writes are the registry's bytes and its
attention over a quantized cache is float attention over the decoded cache; each backend's cache
writes (SET_ROWS, ROPE_SET_ROWS) and reads (ATTN, the unfused GATHER_KV chain, an encoder's
whole-sequence attention) against the reference, at the real models' head dims with GQA, several
sequences over scattered blocks and chunk boundaries; the rotation leaves attention unchanged
(up to the quantization, which it makes smaller on outlier channels). Then the engine on tiny
models: bytes per token, fused == unfused, close to f16, persisted prefixes keyed by the type
(files written before the registry still load), clear refusals, the CLI and server flags; the
cuda kernels' launches (without a GPU) and their block code on the host."""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA
from gguf import quants
from gguf.constants import GGMLQuantizationType as T
from test_backend_ops import BS, BT, GQA, N_BLOCKS, REF, backend, f32, inputs, nmse, rng_for, scenario  # noqa: F401
from test_cuda_launch import fake_ops  # noqa: F401
from tiny_gguf import write_tiny

from hearthlm import Session
from hearthlm.backends.cuda.modules import KERNEL_DIR
from hearthlm.core import kv_types
from hearthlm.core.errors import BackendError, InvalidRequestError
from hearthlm.core.graph import Graph, Op

GGUF = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "iq4_nl": T.IQ4_NL}
KVS = list(kv_types.QUANTIZED)
assert set(KVS) == set(GGUF)
CUDA_KVS = ("q8_0", "q4_0")  # the quantized types attention.cu has kernels for


def rots(spec: str, d: int) -> tuple[int, int]:
    return kv_types.rot_sizes(spec, d)


def encode(x: np.ndarray, spec: str, which: int = 0) -> np.ndarray:
    """x (n, h, d) as a cache's rows of this type (K: which 0, V: 1), by the registry's reference."""
    t, _ = kv_types.parse(spec)
    return kv_types.encode(t, rots(spec, x.shape[-1])[which], x)


def values(cache: np.ndarray, spec: str, d: int, which: int = 0) -> np.ndarray:
    t, _ = kv_types.parse(spec)
    return kv_types.decode(t, rots(spec, d)[which], cache)


def cache_nodes(g: Graph, spec: str, shape, names=("cache_k", "cache_v")):
    """Tagged cache nodes, as runtime.kv_cache.KVCache.typed leaves them."""
    out = []
    for i, name in enumerate(names):
        c = g.cache(name, shape, 0)
        kv_types.tag(c, spec, rots(spec, shape[-1])[i])
        out.append(c)
    return out


def run(be, g: Graph, feed, caches, out_buffers: bool = False):
    """The graph's kernels one by one on `be`; caches (numpy arrays) are copied in.
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


# ---- the registry's references against ggml ----

def test_reference_quantization_is_ggml_bit_for_bit():
    """Each type's numpy quantization gives ggml's bytes (its quantize_row_*_ref, recorded from
    libggml; gguf.quants' too where it has one), and its dequantization gguf's values. iq4_nl's
    all-zero blocks (0 and 1: under 1e-15) keep stale codes in ggml (its L buffer): values only.
    Fails if a block layout moves a byte, a rounding is changed (trunc vs round), iq4_nl's scale
    is left at max / -127 instead of the least-squares one, or its sums are taken in another order."""
    rec = np.load(DATA / "kv_blocks.npz")
    x = rec["x"]
    for kv in KVS:
        t = kv_types.KV_TYPES[kv]
        got = t.quantize(x)
        assert got.dtype == np.uint8 and got.shape == rec[kv].shape
        same = (got == rec[kv]).all(axis=1)
        assert same[2:].all(), (kv, np.flatnonzero(~same))
        assert np.array_equal(t.dequantize(got), np.asarray(quants.dequantize(rec[kv], GGUF[kv]), np.float32)), kv
        if kv != "iq4_nl":
            assert np.array_equal(got, quants.quantize(x, GGUF[kv]).view(np.uint8)), kv
        if kv == "iq4_nl":
            assert not same[:2].all() and not t.dequantize(got[:2]).any()  # ggml's stale codes, values 0


def test_float_types_store_what_they_name():
    """"f16" is float16 and "f32" float32 on every backend (the layout no longer asks the
    backend): fails if f16 falls back to a backend's float32 again."""
    from hearthlm.runtime.kv_cache import kv_layout
    for be in ("cpu", "reference", "cuda"):
        stub = type("B", (), {"name": be})()
        assert kv_layout("f16", [(2, 64), (0, 0)], [stub, stub]) == [((2, 64), np.dtype(np.float16)),
                                                                    ((0, 0), np.dtype(np.float16))]
        assert kv_layout("f32", [(2, 48)], [stub]) == [((2, 48), np.dtype(np.float32))]
    assert kv_layout("q5_1", [(2, 64)], [stub]) == [((2, 48), np.dtype(np.uint8))]
    assert kv_layout("iq4_nl+rot", [(1, 256)], [stub]) == [((1, 144), np.dtype(np.uint8))]


def test_rotation_is_llama_cpps():
    """H is ggml_gen_hadamard's (Sylvester's order, orthonormal, symmetric, its own inverse); K is
    rotated in chunks of the largest power of two dividing head_dim, V in chunks of 64
    (llama_kv_cache::build_input_k_rot / _v_rot), and a rotation leaves dot products as they were."""
    h = np.sign(kv_types.hadamard(8))
    assert np.allclose(np.abs(kv_types.hadamard(8)), 8 ** -0.5)
    assert np.array_equal(h[1], [1, -1] * 4) and np.array_equal(h[2], [1, 1, -1, -1] * 2) and (h == h.T).all()
    assert np.allclose(kv_types.hadamard(64) @ kv_types.hadamard(64), np.eye(64), atol=1e-6)
    assert [rots("q4_0+rot", d) for d in (64, 128, 192, 256)] == [(64, 64), (128, 64), (64, 64), (256, 64)]
    assert rots("q4_0", 256) == (0, 0)
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 3, 256)).astype(np.float32)
    for n in (64, 256):
        assert np.allclose((kv_types.rotate(q, n) * kv_types.rotate(k, n)).sum(-1), (q * k).sum(-1), rtol=1e-5)
        assert np.allclose(kv_types.rotate(kv_types.rotate(q, n), n), q, atol=1e-5)


# ---- cases ----

def kv_write(kv, fused, n_kv, d, scen, which=0):
    seq, pos, slots = scenario(scen)
    rng = rng_for("kvq-write", kv, fused, n_kv, d, scen, which)
    cache = encode(f32(rng, N_BLOCKS * BS, n_kv, d), kv, which)
    x = f32(rng, len(seq), n_kv, d, scale=2.0)
    x[:1, :1, :32] = 0  # an all-zero block: scale 0
    g = Graph()
    c = cache_nodes(g, kv, (N_BLOCKS * BS, n_kv, d), [("cache_k", "cache_v")[which]])[0]
    xi, pi, si = inputs(g, x=x, pos=pos, slots=slots)
    g.outputs.append(g.rope_set_rows(c, xi, pi, si, name="kw", n_rot=d, base=1e4, freq_scale=1.0, neox=True)
                     if fused else g.set_rows(c, xi, si, "kw"))
    return g, {"x": x, "pos": pos, "slots": slots}, {c.name: cache}


def attention(kv, part, shape, scen, window=0, softcap=0.0, causal=True, outliers=0.0):
    """outliers > 0: K has a few channels that large (the keys llama.cpp's rotation is for)."""
    n_head, n_kv, d = shape
    seq, pos, _ = scenario(scen)
    rng = rng_for("kvq-attn", kv, part, shape, scen, window, causal)
    kf, vf = f32(rng, N_BLOCKS * BS, n_kv, d), f32(rng, N_BLOCKS * BS, n_kv, d)
    if outliers:
        kf[..., 3::17] *= outliers
    last = {int(s): int(pos[seq == s].max()) for s in set(seq.tolist())}
    feed = {"q": f32(rng, len(seq), n_head, d), "seq": seq, "pos": pos, "bt": BT}
    if not causal:
        feed["sl"] = np.array([last[int(s)] + 1 for s in seq], np.int32)
    g = Graph()
    q, sq, ps, bt, *sl = inputs(g, **feed)
    sl = sl[0] if sl else None
    kci, vci = cache_nodes(g, kv, (N_BLOCKS * BS, n_kv, d))
    if part == "attn":
        g.outputs.append(g.attn(q, kci, vci, sq, ps, bt, scale=d ** -0.5, block_size=BS, window=window,
                                softcap=softcap, seq_len=sl, name="a"))
    else:  # the unfused chain: K/V gathered (dequantized) through the block table
        k = g.gather_kv(kci, bt, block_size=BS, name="k")
        s = g.scale(g.kq(q, k, sq, "kq"), d ** -0.5, "kq_scaled")
        mask = g.kq_mask(ps, n_kv=k.shape[1], window=window, seq_len=sl, name="mask")
        probs = g.soft_max(g.add(s, mask, "kq_masked"), "probs")
        g.outputs.append(g.kqv(probs, g.gather_kv(vci, bt, block_size=BS, name="v"), sq, "kqv"))
    return g, feed, {"cache_k": encode(kf, kv, 0), "cache_v": encode(vf, kv, 1)}, (kf, vf)


ROTS = [f"{kv}{kv_types.ROT}" for kv in ("q8_0", "q4_0", "iq4_nl")]
WRITES = [pytest.param(kv, f, n_kv, d, s, id=f"{kv}-{'rope' if f else 'set'}-{n_kv}x{d}-{s}")
          for kv in KVS for f in (False, True) for _, n_kv, d in GQA for s in ("empty", "decode", "chunk", "prefill")]
WRITES += [pytest.param(kv, f, n_kv, d, "chunk", id=f"{kv}-{'rope' if f else 'set'}-{n_kv}x{d}-chunk")
           for kv in ROTS for f in (False, True) for _, n_kv, d in GQA[1:]]
ATTNS = [pytest.param(kv, "attn", sh, s, w, id=f"{kv}-attn-{'x'.join(map(str, sh))}-{s}-w{w}")
         for kv in KVS for sh in GQA for s in ("empty", "decode", "chunk", "prefill") for w in (0, 8)]
ATTNS += [pytest.param(kv, "unfused", sh, s, 0, id=f"{kv}-unfused-{'x'.join(map(str, sh))}-{s}")
          for kv in KVS for sh in GQA[:2] for s in ("decode", "chunk", "prefill")]
ATTNS += [pytest.param(kv, part, sh, "chunk", 8, id=f"{kv}-{part}-{'x'.join(map(str, sh))}-chunk-w8")
          for kv in ROTS for part in ("attn", "unfused") for sh in GQA]


def _check_write(got: np.ndarray, want: np.ndarray, kv: str, d: int, which: int, exact: bool) -> None:
    """Bit for bit (set_rows); after RoPE (float32 on the backend, float64 in the reference) or the
    rotation (a butterfly on the backend, a matrix product in the reference) a code may sit one
    step over where a value lands on a rounding boundary, nothing more."""
    if exact:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        return
    a, b = values(got, kv, d, which), values(want, kv, d, which)
    step = np.abs(b).max() / 8 + 1e-30
    off = np.abs(a - b) > 1e-6 * step
    assert off.mean() < 2e-3 and nmse(a, b) < 1e-5, (off.mean(), nmse(a, b))


def test_reference_backend_is_the_registry():
    """The reference's writes are the registry's bytes at the slots (others untouched), and its
    attention over a quantized cache is float attention over the decoded (rotated back) cache.
    Fails if a kernel is chosen by the array's dtype (all quantized caches are uint8 now)."""
    for kv in KVS + ROTS:
        d = 64
        g, feed, caches = kv_write(kv, False, 2, d, "chunk", which=1)
        _, after = run(REF, g, feed, caches)
        want = caches["cache_v"].copy()
        want[feed["slots"]] = encode(feed["x"], kv, 1)
        assert np.array_equal(after["cache_v"], want), kv
        g, feed, caches, _ = attention(kv, "attn", GQA[0], "chunk", window=8)
        (got,), _ = run(REF, g, feed, caches)
        oracle = _float_attention(g, feed, values(caches["cache_k"], kv, d, 0), values(caches["cache_v"], kv, d, 1))
        assert nmse(got, oracle) < 1e-12, kv


@pytest.mark.parametrize("kv,fused,n_kv,d,scen", WRITES)
def test_cache_writes(backend, kv, fused, n_kv, d, scen):
    if backend.name == "cuda" and kv not in CUDA_KVS:
        pytest.skip("no cuda kernels for this type (refused: test_cuda_refuses_what_it_has_no_kernels_for)")
    for which in (0, 1) if kv.endswith(kv_types.ROT) else (0,):
        g, feed, caches = kv_write(kv, fused, n_kv, d, scen, which)
        _, want = run(REF, g, feed, caches)
        _, got = run(backend, g, feed, caches)
        name = next(iter(caches))
        _check_write(got[name], want[name], kv, d, which, exact=not fused and not kv.endswith(kv_types.ROT))


@pytest.mark.parametrize("kv,part,shape,scen,window", ATTNS)
def test_attention_reads_blocks(backend, kv, part, shape, scen, window):
    if backend.name == "cuda" and (shape[2] > 256 or kv not in CUDA_KVS):
        pytest.skip("head dim over the cuda kernel's, or no cuda kernels for this type")
    g, feed, caches, _ = attention(kv, part, shape, scen, window)
    (want,), _ = run(REF, g, feed, caches)
    for out_buffers in (False, True) if backend.plans_memory else (False,):
        (got,), _ = run(backend, g, feed, caches, out_buffers)
        masked = np.isinf(want)
        assert np.array_equal(got[masked], want[masked])
        assert nmse(got[~masked], want[~masked]) < 5e-4


@pytest.mark.parametrize("kv", KVS + ROTS[1:2])
def test_encoder_and_softcap_attention(backend, kv):
    """Non-causal attention over whole inputs (the CPU's batched-product path), and soft-capped scores."""
    if backend.name == "cuda" and kv not in CUDA_KVS:
        pytest.skip("no cuda kernels for this type")
    for args in ((GQA[0], "encode", 0, 0.0, False), (GQA[1], "prefill", 0, 0.0, False), (GQA[0], "chunk", 8, 1.5)):
        shape, scen, window, softcap, *causal = args
        g, feed, caches, _ = attention(kv, "attn", shape, scen, window, softcap, *causal)
        (want,), _ = run(REF, g, feed, caches)
        (got,), _ = run(backend, g, feed, caches)
        assert nmse(got, want) < 5e-4, args


def _float_attention(g, feed, kf, vf):
    """The reference's attention of g's output node over untagged float caches kf, vf."""
    node = g.outputs[0]
    plain = Graph()
    bare = dataclasses.replace(node, srcs=tuple(plain.cache(s.name, s.shape, 0) if s.op is Op.CACHE else s
                                                for s in node.srcs))
    return REF.kernels[Op.ATTN](bare, *({"cache_k": kf, "cache_v": vf}[s.name] if s.op is Op.CACHE else feed[s.name]
                                       for s in node.srcs))


@pytest.mark.parametrize("kv", KVS)
def test_rotation_leaves_attention_unchanged(backend, kv):
    """Attention over a "+rot" cache (the CPU rotates Q and un-rotates the output; the reference
    un-rotates K and V) is attention over the float K/V, up to the quantization; on keys with
    outlier channels the rotated cache is the closer one (what llama.cpp's rotation is for).
    Fails if Q is not rotated with K, V's rotation is not undone, or the two use other sizes."""
    if backend.name == "cuda":
        pytest.skip("no cuda kernels for the rotation")
    errs = {}
    for spec in (kv, kv + kv_types.ROT):
        g, feed, caches, (kf, vf) = attention(spec, "attn", GQA[3], "chunk", outliers=10.0)
        (got,), _ = run(backend, g, feed, caches)
        errs[spec] = nmse(got, _float_attention(g, feed, kf, vf))
    # measured (cpu): q8_0 2.6e-4 -> 1.1e-4, q4_0 0.061 -> 0.022, q5_0 0.015 -> 0.0059,
    # q5_1 0.011 -> 0.0048, iq4_nl 0.042 -> 0.021
    bound = {"q8_0": 2e-4, "q4_0": 0.03, "q5_0": 0.008, "q5_1": 0.007, "iq4_nl": 0.03}[kv]
    assert errs[kv + kv_types.ROT] < bound and errs[kv + kv_types.ROT] < 0.6 * errs[kv], errs


# ---- the engine on tiny models ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:  # head_dim 32
    return str(write_tiny(tmp_path_factory.mktemp("kvq") / "tiny.gguf", n_embd=128, n_head=4, n_head_kv=2,
                          n_layer=2))


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory) -> str:  # head_dim 64: the rotation's smallest
    return str(write_tiny(tmp_path_factory.mktemp("kvq64") / "tiny64.gguf", n_embd=128, n_head=2, n_head_kv=1,
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
    # per token: 2 layers x K and V x 2 heads x 32 values, at 2 bytes; 34, 18, 22, 24, 18 bytes per 32
    want = {"f32": 1024, "q4_0": 144, "q5_0": 176, "q5_1": 192, "iq4_nl": 144}
    lps = {}
    for kv, n in want.items():
        _, lps[kv], st = await first_step(tiny, kv_cache_type=kv)
        assert st["kv_cache_type"] == kv and st["kv_bytes_per_token"] == n, (kv, st["kv_bytes_per_token"])
    assert (st16["kv_bytes_per_token"], st8["kv_bytes_per_token"]) == (512, 272)
    assert st8["kv_cache_type"] == "q8_0" and st8["kv_cache_bytes"] == st16["kv_cache_bytes"] * 34 // 64
    # fused == unfused: the two attention paths agree to ~1e-7 (the op suite), but the next layer's
    # int8 activations can round such a difference to ~1e-3 of this peaked tiny model's logits (-60:
    # the AVX-512 kernels sum in another order than the AVX2 ones, where they came out bitwise equal)
    assert ids8u == ids8 and all(abs(lp8u[t] - lp8[t]) <= 1e-2 * abs(lp8[t]) + 1e-4 for t in lp8)
    top = max(lp16, key=lp16.get)
    assert abs(lp8[top] - lp16[top]) < 0.02 and abs(lps["f32"][top] - lp16[top]) < 0.02
    assert all(abs(lps[kv][top] - lp16[top]) < 0.2 for kv in ("q4_0", "q5_0", "q5_1", "iq4_nl")), lps


async def test_engine_rotation(tiny64):
    """q4_0+rot on a model of head_dim 64: the same bytes as q4_0, fused == unfused, near f16."""
    ids16, lp16, _ = await first_step(tiny64)
    ids, lp, st = await first_step(tiny64, kv_cache_type="q4_0+rot")
    idsu, lpu, _ = await first_step(tiny64, kv_cache_type="q4_0+rot", fusion=False)
    assert st["kv_cache_type"] == "q4_0+rot" and st["kv_bytes_per_token"] == 2 * 2 * 64 // 32 * 18
    assert idsu == ids and all(abs(lpu[t] - lp[t]) <= 1e-2 * abs(lp[t]) + 1e-4 for t in lp)
    top = max(lp16, key=lp16.get)
    assert abs(lp[top] - lp16[top]) < 0.2


async def test_refusals(tmp_path, tiny):
    with pytest.raises(InvalidRequestError, match="f16, q8_0, q4_0, q5_0, q5_1, iq4_nl, f32"):
        async with Session.open(tiny, kv_cache_type="q8"):
            pass
    for bad in ("f16+rot", "q4_0+rot+rot", "Q4_0"):
        with pytest.raises(InvalidRequestError, match="kv_cache_type must be one of"):
            async with Session.open(tiny, kv_cache_type=bad):
                pass
    with pytest.raises(InvalidRequestError, match="head_dim is 32, not a multiple of 64: use q4_0"):
        async with Session.open(tiny, kv_cache_type="q4_0+rot", weight_cache=False):
            pass
    odd = str(write_tiny(tmp_path / "hd16.gguf"))  # head_dim 16
    with pytest.raises(InvalidRequestError, match="head_dim is 16"):
        async with Session.open(odd, kv_cache_type="q5_1", weight_cache=False):
            pass
    async with Session.open(odd, weight_cache=False) as s:  # f16 takes any head_dim
        assert s.stats()["kv_cache_type"] == "f16"


async def test_persisted_prefixes_keyed_by_type(tiny64, tmp_path):
    """A q8_0 session's prefix file serves a later q8_0 session (same answer as computing it) and
    never an f16, q4_0 or q8_0+rot one (other keys: their files do not mix)."""
    async def ask(kv, **kw):
        async with Session.open(tiny64, n_ctx=512, weight_cache=False, prompt_cache_dir=tmp_path,
                                kv_cache_type=kv, **kw) as s:
            c = await s.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=1)
            return c.token_ids, [t[0][1] for t in c.top_logprobs], s.stats()
    ref = await ask("q8_0", prompt_cache=False)
    async with Session.open(tiny64, n_ctx=512, weight_cache=False, prompt_cache_dir=tmp_path,
                            kv_cache_type="q8_0") as s:
        assert await s.cache_prefix(PROMPT[:160]) == 160
    ids, lps, st = await ask("q8_0")
    assert st["prompt_cache_loaded_tokens"] == 160 and ids == ref[0] and lps == pytest.approx(ref[1], abs=1e-5)
    for other in ("f16", "q4_0", "q8_0+rot"):
        assert (await ask(other))[2]["prompt_cache_loaded_tokens"] == 0, other


def test_prompt_cache_key_and_files_from_before_the_registry(tmp_path):
    """The prompt cache's key names f16 / q8_0 / q4_0 as it did before the registry ("<f2" for a
    float16 cache, the name for a quantized one), and a file of q8_0 blocks saved as int8 (their
    dtype then) loads into today's uint8 cache: files written before still serve. Fails if the key
    takes the type's new name for f16, or the loader refuses the old dtype."""
    from hearthlm.runtime import array_file
    from hearthlm.runtime.kv_cache import KVCache
    from hearthlm.runtime.prompt_cache import FORMAT, MAGIC, PromptCache, digests
    cpu = type("B", (), {"name": "cpu", "zeros": staticmethod(np.zeros)})()
    dims = [(2, 64), (0, 0)]
    assert KVCache(dims, 4, 16, [cpu, cpu], "f16").key() == [["cpu", "<f2", 2, 64], ["cpu", "<f2", 0, 0]]
    assert KVCache(dims, 4, 16, [cpu, cpu], "q8_0").key() == [["cpu", "q8_0", 2, 64], ["cpu", "q8_0", 0, 0]]
    assert KVCache(dims, 4, 16, [cpu, cpu], "q4_0").key()[0] == ["cpu", "q4_0", 2, 64]
    assert KVCache(dims, 4, 16, [cpu, cpu], "f32").key()[0] == ["cpu", "<f4", 2, 64]
    assert KVCache(dims, 4, 16, [cpu, cpu], "q4_0+rot").key()[0] == ["cpu", "q4_0+rot", 2, 64]
    key = dict(model="m", block_size=16, state=None, kv=KVCache(dims, 4, 16, [cpu, cpu], "q8_0").key())
    pc = PromptCache(tmp_path, key, block_size=16, hybrid=False)
    tokens = list(range(32))
    old = np.arange(32 * 2 * 68).astype(np.uint8).view(np.int8).reshape(32, 2, 68)  # q8_0 blocks, as int8
    ds = digests(tokens, 16, 2)
    path = tmp_path / f"{pc.tag}-{ds[-1]}.hlp"
    array_file.write(path, MAGIC, FORMAT, dict(key=pc.key, digests=ds, n_tokens=32), {"k0": old, "v0": old})
    got = pc.load(path, 2)
    assert got["k0"].dtype == np.uint8 and np.array_equal(got["k0"].view(np.int8), old)


async def test_encoder_embeds_with_a_quantized_cache(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "parity"))
    from encoders import HP, TEXTS, _write_bert
    path = str(_write_bert(tmp_path / "bert.gguf", "bert", 1, True, False, 0,
                           hp={**HP, "embedding_length": 64, "attention.head_count": 2}))  # head_dim 32
    embs = {}
    for kv in ("f16", "q8_0", "q5_1"):
        async with Session.open(path, weight_cache=False, kv_cache_type=kv) as s:
            embs[kv] = np.asarray(await s.embed(TEXTS), np.float64)
    for kv in ("q8_0", "q5_1"):
        cos = (embs["f16"] * embs[kv]).sum(1) / np.linalg.norm(embs["f16"], axis=1) / np.linalg.norm(embs[kv], axis=1)
        assert cos.min() > 0.999, kv


def test_cli_and_server_take_the_type(tiny, capsys, monkeypatch):
    from hearthlm import cli
    assert cli.main(["generate", "t t", "--model", tiny, "--max-tokens", "3", "--kv-cache-type", "q8_0"]) == 0
    assert cli.main(["generate", "t t", "--model", tiny, "--max-tokens", "3", "--kv-cache-type", "iq4_nl"]) == 0
    assert cli.main(["generate", "t t", "--model", tiny, "--kv-cache-type", "q6_k"]) == 1
    assert "q8_0, q4_0, q5_0, q5_1, iq4_nl" in capsys.readouterr().err
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
    """Each cache op's kernel of the cache's type (read from its CACHE node), its arguments fitting
    the .cu signature (test_cuda_launch's checker), results shaped as the node; none on an empty
    batch. f16 is stored float16 (cupy's casts write it; attn_paged_f16 reads it): its cache after a
    write holds the reference's float16 values."""
    ops, cp, launches = fake_ops
    for kv in ("f16", "f32", *CUDA_KVS):
        for build, kw in ((kv_write, dict(fused=False, n_kv=2, d=64, scen="chunk")),
                          (kv_write, dict(fused=True, n_kv=2, d=64, scen="chunk")),
                          (kv_write, dict(fused=True, n_kv=2, d=64, scen="empty")),
                          (attention, dict(part="attn", shape=GQA[3], scen="chunk")),
                          (attention, dict(part="attn", shape=GQA[3], scen="empty")),
                          (attention, dict(part="unfused", shape=GQA[0], scen="decode"))):
            launches.clear()
            g, feed, caches, *_ = build(kv, **kw)
            live = {k: c.copy() for k, c in caches.items()}
            for node in g.nodes:  # only the ops that touch the cache: the rest are float as before
                if node.op in (Op.SET_ROWS, Op.ROPE_SET_ROWS, Op.ATTN, Op.GATHER_KV):
                    srcs = [live[s.name] if s.op is Op.CACHE else np.array(feed[s.name]) for s in node.srcs]
                    with np.errstate(over="ignore"):  # a launch is not run: its outputs are np.empty's
                        y = ops.KERNELS[node.op](node, *srcs)
                    assert node.op.props.writes_cache or y.shape == node.shape
            fns = {fn for fn, _ in launches}
            suffix = {"f16": "_f16", "f32": ""}.get(kv, f"_{kv}")
            store = {"f16": set(), "f32": set()}.get(kv, {f"kv_store_{kv}"})
            want = {"set_rows": store | ({"rope"} if kw.get("fused") else set()), "attn": {f"attn_paged{suffix}"},
                    "unfused": set() if suffix in ("", "_f16") else {f"kv_dequant{suffix}"}}[kw.get("part", "set_rows")]
            assert (not fns) if kw["scen"] == "empty" else fns == want, (kv, kw, fns)
            if kv in ("f16", "f32") and build is kv_write and not kw["fused"]:
                _, ref = run(REF, g, feed, caches)
                assert live["cache_k"].dtype == kv_types.KV_TYPES[kv].storage
                assert np.array_equal(live["cache_k"], ref["cache_k"])


def test_cuda_refuses_what_it_has_no_kernels_for(fake_ops):
    """q5_0, q5_1, iq4_nl and the "+rot" types have no cuda kernels: each cache op says so by name
    when it is bound, nothing launched (the session fails at open, when the first graph compiles)."""
    ops, cp, launches = fake_ops
    for kv in ("q5_0", "q5_1", "iq4_nl", "q4_0+rot", "q8_0+rot"):
        for build, kw in ((kv_write, dict(fused=False, n_kv=2, d=64, scen="chunk")),
                          (kv_write, dict(fused=True, n_kv=2, d=64, scen="chunk")),
                          (attention, dict(part="attn", shape=GQA[3], scen="chunk")),
                          (attention, dict(part="unfused", shape=GQA[0], scen="decode"))):
            g, feed, caches, *_ = build(kv, **kw)
            node = next(n for n in g.nodes if n.op in (Op.SET_ROWS, Op.ROPE_SET_ROWS, Op.ATTN, Op.GATHER_KV))
            srcs = [caches[s.name].copy() if s.op is Op.CACHE else np.array(feed[s.name]) for s in node.srcs]
            with pytest.raises(BackendError, match=f"KV cache type {kv.replace('+', '[+]')} has no cuda kernels"):
                ops.KERNELS[node.op](node, *srcs)
    assert not launches


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
    for kv in CUDA_KVS:
        want = quants.quantize(x, GGUF[kv])
        got = np.zeros_like(want)
        lib.host_quantize(int(GGUF[kv]), x.ctypes.data_as(P), 64, got.ctypes.data_as(P))
        assert np.array_equal(got, want), kv
        vals = np.zeros((64, 32), np.float32)
        lib.host_values(int(GGUF[kv]), want.ctypes.data_as(P), 64, vals.ctypes.data_as(P))
        assert np.array_equal(vals, quants.dequantize(want, GGUF[kv])), kv
    f = np.concatenate([rng.standard_normal(2000) * s for s in (1e-7, 1e-5, 1, 1e4)]).astype(np.float32)
    f = np.concatenate([f, np.float32([0, 6e-8, 3e-8, 65504, 65519, 65520, 1e6, np.inf, -np.inf])])
    with np.errstate(over="ignore"):
        assert [lib.host_f2h(float(v)) for v in f] == list(f.astype(np.float16).view(np.uint16))


def test_kv_types_by_name():
    """The registry's records and the option's parsing; what a node carries and a kernel reads."""
    t = kv_types.KV_TYPES["q5_1"]
    assert (t.block, t.block_bytes, t.storage, t.row(64), t.head_dim(48)) == (32, 24, np.dtype(np.uint8), 48, 64)
    assert [kv_types.KV_TYPES[n].row(64) for n in ("f16", "q8_0", "q4_0", "q5_0", "iq4_nl", "f32")] == \
        [64, 68, 36, 44, 36, 64]
    assert kv_types.parse("iq4_nl+rot") == (kv_types.KV_TYPES["iq4_nl"], True)
    assert kv_types.check("q8_0", [(0, 0), (2, 48)]) and not kv_types.check("q8_0", [(0, 0), (2, 64)])
    assert kv_types.check("q8_0+rot", [(2, 96)]) and not kv_types.check("q8_0+rot", [(2, 192)])
    g = Graph()
    k, v = cache_nodes(g, "q4_0+rot", (32, 2, 256))
    w = g.set_rows(v, g.input("x", (3, 2, 256), np.float32), g.input("s", (3,)), "vw")
    assert kv_types.of(k) == (kv_types.KV_TYPES["q4_0"], 256) and kv_types.of(w) == (kv_types.KV_TYPES["q4_0"], 64)
    assert kv_types.of(g.cache("state", (4, 8), 0)) == (None, 0)  # untagged: a float cache


def test_f16_store_without_native_conversion():
    """On a CPU target without float16 conversions (NUMBA_CPU_NAME=generic: no F16C) an "f16" cache
    is still float16, narrowed by bit arithmetic to numpy's rounding (it was a float32 cache there)."""
    code = """
import numpy as np
from hearthlm.backends.cpu import halfs, ops
assert not halfs.NATIVE_HALF
rng = np.random.default_rng(0)
src = np.concatenate([rng.standard_normal(3003) * s for s in (1e-7, 1e-5, 1, 1e4)]).astype(np.float32)
src = np.concatenate([src, np.float32([0, 6e-8, 3e-8, 65504, 65519, 65520, 1e6])]).reshape(-1, 1, 7)
cache = np.zeros((len(src), 1, 7), np.float16)
ops.set_rows_1(cache.view(np.uint16), src, np.arange(len(src), dtype=np.int32), 1, 0)
with np.errstate(over="ignore"):
    assert np.array_equal(cache.view(np.uint16), src.astype(np.float16).view(np.uint16))
print("ok")
"""
    env = dict(os.environ, NUMBA_CPU_NAME="generic")  # its kernels beside the host's in the cache
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
