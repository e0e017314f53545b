"""The cuda backend's launches, checked without a GPU: backends/cuda/ops.py is imported over
numpy standing in for cupy, and each kernel launch is checked and recorded instead of run.
Every op of ops.KERNELS runs on an empty batch (a prompt chunk that wants no logits) and on
a small one. Checked: no launch on an empty grid (the driver rejects it), results shaped as
the graph node, and each launch's arguments against the kernel's parameters in the .cu
source (count, scalar width, pointer element type): CuPy passes a numpy scalar by its own
width, so an int64 where the kernel takes an int would shift every later argument.
What the kernels compute is the op suite's business, on a GPU (tests/test_backend_ops.py)."""
import importlib
import re
import sys
import types

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends.cuda.modules import CU_FILES, source
from hearthlm.backends.cuda.weights import QUANT_KERNELS, upload
from hearthlm.core.graph import Graph, Op
from hearthlm.core.weights import QWeight

SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32, "double": np.float64}
POINTEES = {"float": np.float32, "double": np.float64, "int": np.int32, "u8": np.uint8, "i8": np.int8}
_SIG = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\)\s*)?(\w+?)(##name)?\s*\(([^)]*)\)', re.S)


def _param(text: str):
    """'const float* __restrict__ x' -> ('ptr', float32); 'long long n' -> ('val', int64)."""
    words = text.replace("\\", " ").replace("__restrict__", " ").replace("const", " ").split()
    ctype = " ".join(words[:-1])
    if ctype.endswith("*"):
        return "ptr", POINTEES[ctype[:-1].strip()]
    return "val", SCALARS[ctype]


def signatures() -> dict[tuple[str, str], list]:
    """{(file, kernel): [(kind, dtype) per parameter]}, INSTANTIATE(T, name)'s kernels expanded."""
    sigs = {}
    for f in CU_FILES:
        text = source(f)
        names = re.findall(r"^INSTANTIATE\(\w+, (\w+)\)", text, re.M)
        for fn, templated, params in _SIG.findall(text):
            ps = [_param(p) for p in params.split(",")]
            for suffix in (names if templated else [""]):
                sigs[(f, fn + suffix)] = ps
    return sigs


SIGS = signatures()


def test_signatures_were_read():
    assert {("matmul.cu", "mmvq_" + k) for k in QUANT_KERNELS.values()} <= set(SIGS)
    assert {("matmul.cu", "quantize_q8"), ("norm_rope.cu", "rms_norm"), ("norm_rope.cu", "glu"),
            ("norm_rope.cu", "rope"), ("attention.cu", "attn_paged"), ("ssm.cu", "ssm_conv"),
            ("ssm.cu", "ssm_scan"), ("delta_net.cu", "gated_delta_net")} <= set(SIGS)
    assert SIGS[("norm_rope.cu", "rope")][-7:] == ([("val", np.float64)] * 2 + [("val", np.int32)] * 2
                                                   + [("ptr", np.float64), ("val", np.int32), ("val", np.float64)])


def _launcher(file: str, fn: str, launches: list):
    assert (file, fn) in SIGS, f"no kernel {fn} in {file}"

    def launch(grid, block, args):
        assert all(int(d) > 0 for d in (*grid, *block)), f"{fn}: empty launch grid {grid} block {block}"
        params = SIGS[(file, fn)]
        assert len(args) == len(params), f"{fn}: {len(args)} arguments for {len(params)} parameters"
        for i, (a, (kind, dt)) in enumerate(zip(args, params)):
            if kind == "ptr":
                assert isinstance(a, np.ndarray) and a.dtype == dt and a.flags.c_contiguous, \
                    f"{fn} argument {i}: want a dense {np.dtype(dt)} array, got {getattr(a, 'dtype', type(a))}"
            else:
                assert type(a) is dt, f"{fn} argument {i}: want {dt.__name__}, got {type(a).__name__}"
        launches.append((fn, tuple(grid)))
    return launch


@pytest.fixture
def fake_ops(monkeypatch):
    """ops imported afresh with numpy as `cupy`; put back as it was afterwards."""
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.asnumpy = np.asarray  # cupy's own names that numpy lacks
    monkeypatch.setitem(sys.modules, "cupy", fake)
    pkg = importlib.import_module("hearthlm.backends.cuda")
    saved = sys.modules.pop("hearthlm.backends.cuda.ops", None), pkg.__dict__.pop("ops", None)
    try:
        ops = importlib.import_module("hearthlm.backends.cuda.ops")
        launches: list = []
        ops.kernel = lambda file, fn: _launcher(file, fn, launches)
        yield ops, fake, launches
    finally:
        sys.modules.pop("hearthlm.backends.cuda.ops", None)
        pkg.__dict__.pop("ops", None)
        if saved[0] is not None:
            sys.modules["hearthlm.backends.cuda.ops"] = saved[0]
        if saved[1] is not None:
            pkg.ops = saved[1]


E, H, HKV, D, FF, BS, N_SLOTS = 64, 4, 2, 16, 96, 4, 32
rng = np.random.default_rng(3)


def _weight(name, qtype, rows, cols):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = w if qtype == T.F32 else quants.quantize(w, qtype)
    return QWeight(name, int(qtype), (rows, cols), np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1))


def _experts(qtype, n_exp=3, rows=16):
    w = _weight("exps", qtype, n_exp * rows, E)
    return QWeight("exps", w.ggml_type, (n_exp, rows, E), w.raw)


def _case(op: Op, n: int, qtype=T.Q8_0, snap: bool = False):
    """(graph node of `op` over n tokens, values of its inputs by name); `snap`: a recurrent op
    with its per-token snapshot slots."""
    g = Graph()
    f = lambda name, *shape: g.input(name, shape, np.float32)  # noqa: E731
    i = lambda name, *shape: g.input(name, shape)  # noqa: E731
    w = lambda name, rows, cols: g.weight(_weight(name, qtype, rows, cols))  # noqa: E731
    x, xh = f("x", n, E), f("xh", n, H, D)
    seq, pos, slots, bt = i("seq", n), i("pos", n), i("slots", n), i("bt", 2, 3)
    kc, vc = g.cache("kc", (N_SLOTS, HKV, D), 0), g.cache("vc", (N_SLOTS, HKV, D), 0)
    rope = dict(n_rot=D, base=10000.0, freq_scale=1.0, neox=True)
    seq_off, state_slot = i("seq_off", 3), i("state_slot", 2)  # two sequence rows, 4 state slots
    sn = i("snap", n) if snap else None
    ab = lambda rows: [(g.weight(_weight("la", T.F32, 8, E)), g.weight(_weight("lb", T.F32, 8, rows)))]  # noqa: E731
    node = {
        Op.GET_ROWS: lambda: g.get_rows(w("emb", 50, E), i("ids", n), "r"),
        Op.MUL_MAT: lambda: g.mul_mat(w("w", 40, E), x, "y"),
        Op.MUL_MAT_ADD: lambda: g.mul_mat_add(w("w", E, E), x, f("r", n, E), "y"),
        Op.FFN_GLU: lambda: g.ffn_glu(w("g", FF, E), w("u", FF, E), x, "gelu", "y"),
        Op.RMS_NORM: lambda: g.rms_norm(x, 1e-5, "n"),
        Op.RMS_NORM_MUL: lambda: g.rms_norm_mul(xh, f("wd", D), 1e-5, "n"),
        Op.RMS_NORM_MUL_ADD: lambda: g.rms_norm_mul_add(x, f("we", E), f("r", n, E), 1e-5, "n"),
        Op.MUL: lambda: g.mul(x, f("we", E), "m"),
        Op.ADD: lambda: g.add(x, f("r", n, E), "a"),
        Op.ADD_N: lambda: g.add_n([x, f("r", n, E), x], "a"),
        Op.SCALE: lambda: g.scale(x, 0.5, "s"),
        Op.SILU: lambda: g.silu(x, "s"),
        Op.GELU: lambda: g.gelu(x, "s"),
        Op.GLU: lambda: g.glu(x, f("r", n, E), "silu", "s"),
        Op.RESHAPE: lambda: g.reshape(x, (n, H, D), "r"),
        Op.SLICE: lambda: g.slice(x, 8, 24, "s"),
        Op.ROPE: lambda: g.rope(xh, pos, name="r", **rope),
        Op.SET_ROWS: lambda: g.set_rows(kc, f("k", n, HKV, D), slots, "kw"),
        Op.ROPE_SET_ROWS: lambda: g.rope_set_rows(kc, f("k", n, HKV, D), pos, slots, name="kw", **rope),
        Op.ATTN: lambda: g.attn(xh, kc, vc, seq, pos, bt, scale=0.25, block_size=BS, name="a"),
        Op.GATHER_KV: lambda: g.gather_kv(kc, bt, block_size=BS, name="k"),
        Op.KQ: lambda: g.kq(xh, f("kg", 2, 3 * BS, HKV, D), seq, "kq"),
        Op.KQ_MASK: lambda: g.kq_mask(pos, n_kv=3 * BS, name="m"),
        Op.ATTN_TEMP: lambda: g.attn_temp(pos, floor=4, beta=0.1, name="t"),
        Op.SOFT_MAX: lambda: g.soft_max(f("s", n, H, 3 * BS), "p"),
        Op.KQV: lambda: g.kqv(f("p", n, H, 3 * BS), f("vg", 2, 3 * BS, HKV, D), seq, "o"),
        Op.TANH: lambda: g.tanh(x, "t"),
        Op.TOP_K: lambda: g.top_k(f("r8", n, 8), 2, "ids"),
        Op.TAKE: lambda: g.take(f("r8", n, 8), i("ids2", n, 2), "w"),
        Op.SUM_ROWS: lambda: g.sum_rows(x, "s"),
        Op.DIV: lambda: g.div(x, f("r", n, E), "d"),
        Op.MUL_MAT_ID: lambda: g.mul_mat_id(g.weight(_experts(qtype)), x, i("ids2", n, 2), "y"),
        Op.SIGMOID: lambda: g.sigmoid(x, "s"),
        Op.SOFTPLUS: lambda: g.softplus(x, "s"),
        Op.CLAMP: lambda: g.clamp(x, -0.5, 0.75, "c"),
        Op.L2_NORM: lambda: g.l2_norm(xh, 1e-6, "n"),
        Op.SSM_CONV: lambda: g.ssm_conv(g.cache("sc", (4, 3, E), 0), x, g.weight(_weight("conv", T.F32, E, 4)),
                                        seq_off, state_slot, name="c", snap_slot=sn),
        Op.SSM_SCAN: lambda: g.ssm_scan(g.cache("ss", (4, H, D, 32), 0), xh, f("dt", n, H), f("A", 1, H),
                                        f("B", n, 2, 32), f("C", n, 2, 32), seq_off, state_slot, name="y",
                                        snap_slot=sn),
        Op.MUL_MAT_LORA: lambda: g.proj_lora(Op.MUL_MAT_LORA, (w("w", 40, E), x), f("ls", n, 2), [(ab(40), (1,), (16.0,))],
                                             "y"),
        Op.MUL_MAT_ADD_LORA: lambda: g.proj_lora(Op.MUL_MAT_ADD_LORA, (w("w", E, E), x, f("r", n, E)), f("ls", n, 2),
                                                 [(ab(E), (0,), (0.0,))], "y"),
        Op.FFN_GLU_LORA: lambda: g.proj_lora(Op.FFN_GLU_LORA, (w("g", FF, E), w("u", FF, E), x), f("ls", n, 2),
                                             [(ab(FF), (1,), (16.0,)), ([], (), ())], "y", act="silu"),
        Op.LORA: lambda: g.lora(f("y", n, 16), x, f("ls", n, 2), [(g.weight(_weight("la", T.F32, 8, E)),
                                                                  g.weight(_weight("lb", T.F32, 8, 16)))],
                                cols=(1,), alphas=(16.0,), name="l"),  # one rank-8 adapter, E -> 16
        Op.PATCHIFY: lambda: g.patchify(f("img", 1, 3, 4, 4 * n), 4, "p"),  # n patches of 4x4
        Op.ATTN_FULL: lambda: g.attn_full(xh, f("kf", n, HKV, D), f("vf", n, HKV, D), scale=0.25, seg=i("segs", n),
                                          name="a"),
        Op.POOL_2D: lambda: g.pool_2d(f("xp", 4 * n, E), nx=2, ny=2, k=2, name="p"),  # n images of 2x2 patches
        Op.GATED_DELTA_NET: lambda: g.gated_delta_net(  # d_k 32, d_v 16; 4 v-heads over 2 key heads
            g.cache("sd", (4, H, D, 32), 0), f("q", n, HKV, 32), f("k", n, HKV, 32), xh, f("gate", n, H),
            f("beta", n, H), seq_off, state_slot, scale=32 ** -0.5, name="o", snap_slot=sn),
    }[op]()
    feed = {"seq": np.arange(n, dtype=np.int32) % 2, "pos": np.arange(n, dtype=np.int32) % 10 + 1,
            "bt": np.array([[5, 2, 7], [1, 6, 3]], np.int32), "ids": np.arange(n, dtype=np.int32) * 3,
            "ids2": (np.arange(2 * n, dtype=np.int32) % 3).reshape(n, 2),  # 3 experts; 8 router columns
            "seq_off": np.array([0, min(n, 2), n], np.int32), "state_slot": np.array([1, 3], np.int32),
            "segs": np.arange(n, dtype=np.int32) // 3,  # attention runs of 3 tokens
            "snap": np.where(np.arange(n) % 2 == 0, 2, -1).astype(np.int32)}  # state slots 1, 3 run; 2 free
    feed["slots"] = np.array([feed["bt"][s, p // BS] * BS + p % BS for s, p in zip(feed["seq"], feed["pos"])],
                             np.int32).reshape(n)
    return node, feed


def _values(node, feed, cp):
    """The node's source values: weights uploaded as the backend does, inputs and caches made up."""
    out = []
    for s in node.srcs:
        if s.op is Op.WEIGHT and len(s.shape) == 3:  # stacked experts: one device weight each, as the backend
            w, rows = s.params["weight"], s.shape[1]
            out.append(tuple(upload(cp, QWeight(f"{w.name}#{e}", w.ggml_type, w.shape[1:], w.raw[e * rows:(e + 1) * rows]))
                             for e in range(s.shape[0])))
        elif s.op is Op.WEIGHT:
            out.append(upload(cp, s.params["weight"]))
        elif s.name in feed:
            out.append(feed[s.name])
        else:
            out.append(rng.standard_normal(s.shape).astype(np.float32))
    return out


# 12: mmvq in two launches; 40 > MMVQ_MAX_TOKENS: dequantize + cuBLAS
@pytest.mark.parametrize("n", [0, 3, 12, 40], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("op", [op for op in Op if op not in (Op.INPUT, Op.WEIGHT, Op.CACHE, Op.COPY)],
                         ids=lambda op: op.value)
def test_launches(fake_ops, op, n):
    ops, cp, launches = fake_ops
    assert op in ops.KERNELS, f"the cuda backend has no kernel for {op.value}"
    node, feed = _case(op, n)
    y = ops.KERNELS[op](node, *_values(node, feed, cp))
    assert y.shape == node.shape
    if n == 0:
        assert launches == [], "an empty batch launched kernels"


@pytest.mark.parametrize("n", [0, 3, 12], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("op", [Op.SSM_CONV, Op.SSM_SCAN, Op.GATED_DELTA_NET], ids=lambda op: op.value)
def test_state_ops_with_snapshots_launch(fake_ops, op, n):
    """A recurrent op with its snapshot slots (speculative verification rows) passes them and
    has_snap = 1 to its kernel; without, a pointer and 0.
    Mutation: ops._snap passing has_snap as a Python int fails it (and a missing argument too)."""
    ops, cp, launches = fake_ops
    for snap in (True, False):
        node, feed = _case(op, n, snap=snap)
        calls = []
        real = ops._launch
        ops._launch = lambda file, fn, grid, block, args: (calls.append(args), real(file, fn, grid, block, args))
        try:
            assert ops.KERNELS[op](node, *_values(node, feed, cp)).shape == node.shape
        finally:
            ops._launch = real
        args = calls[0]
        flag = next(j for j, a in enumerate(args) if type(a) is np.int32)  # has_snap: the first scalar
        assert int(args[flag]) == int(snap)
        if snap:
            assert np.array_equal(args[flag - 1], feed["snap"])
    assert len(launches) == (0 if n == 0 else 2)


@pytest.mark.parametrize("qtype", [T(t) for t in QUANT_KERNELS], ids=lambda t: t.name)
def test_every_quant_type_has_its_kernels(fake_ops, qtype):
    """mmvq and dequant of each type: the kernel exists, and its arguments fit."""
    ops, cp, launches = fake_ops
    cols = 256  # a K-quant super-block
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (8, cols // block * size), dtype=np.uint8)
    w = upload(cp, QWeight("w", int(qtype), (8, cols), raw))
    x = rng.standard_normal((2, cols)).astype(np.float32)
    assert ops.mmvq(w, x).shape == (2, 8)
    assert ops.dequant_rows(w, ids=np.array([1, 7], np.int32)).shape == (2, cols)
    assert [fn for fn, _ in launches] == ["quantize_q8", "mmvq_" + w.kernel, "dequant_" + w.kernel]


@pytest.mark.parametrize("n", [0, 3, 12], ids=lambda n: f"{n}tok")
def test_alibi_launches(fake_ops, n):
    """ALiBi (jina-bert-v2): the fused kernel takes the positions and max_bias, the mask one row per head."""
    ops, cp, launches = fake_ops
    g = Graph()
    pos, seq, bt, sl = g.input("pos", (n,)), g.input("seq", (n,)), g.input("bt", (2, 3)), g.input("sl", (n,))
    q = g.input("xh", (n, H, D), np.float32)
    kc, vc = g.cache("kc", (N_SLOTS, HKV, D), 0), g.cache("vc", (N_SLOTS, HKV, D), 0)
    feed = _case(Op.ATTN, n)[1]
    feed["sl"] = np.full(n, 11, np.int32)
    for node in (g.attn(q, kc, vc, seq, pos, bt, scale=0.25, block_size=BS, alibi=8.0, seq_len=sl, name="a"),
                 g.kq_mask(pos, n_kv=3 * BS, seq_len=sl, alibi=8.0, n_head=H, name="m")):
        y = ops.KERNELS[node.op](node, *_values(node, feed, cp))
        assert y.shape == node.shape
    assert [fn for fn, _ in launches] == ([] if n == 0 else ["attn_paged"])


def test_mmvq_token_groups_address_their_rows(fake_ops):
    """Over MAX_TOKENS tokens mmvq launches once per group of 8 on row slices of the codes, r and
    y: each launch, run here in numpy as the kernel indexes (chunk tc = t * n_chunks + c of its
    own arguments), writes through its views, and 20 tokens come out as x @ W.T + r."""
    ops, cp, launches = fake_ops
    rows, cols, n = 24, 128, 20
    qw = _weight("w", T.Q8_0, rows, cols)
    w = upload(cp, qw)
    blocks = qw.raw.reshape(rows, cols // 32, 34)
    wd = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, n_chunks)
    wq = blocks[:, :, 2:].view(np.int8).astype(np.int32)                      # (rows, n_chunks, 32)

    def quantize_q8(grid, block, args):
        x, n_chunks, xq, xd, xs = args
        c = x.reshape(int(n_chunks), 32)
        d = np.abs(c).max(axis=1) / 127
        xq[...] = np.round(c / np.where(d > 0, d, 1)[:, None]).reshape(xq.shape)
        xd[...] = d
        xs[...] = c.reshape(-1, 2, 16).sum(axis=2).reshape(-1)

    def mmvq(grid, block, args):
        _w, _w2, _rb, n_rows, n_chunks, xq, xd, xs, n_tok, r, y, mode = args
        assert int(n_tok) <= ops.MAX_TOKENS and xq.shape[0] == y.shape[0] == int(n_tok)
        q = xq.reshape(int(n_tok), int(n_chunks), 32).astype(np.int32)
        d = xd.reshape(int(n_tok), int(n_chunks))
        y[...] = np.einsum("rcj,tcj,rc,tc->tr", wq, q, wd, d) + (r if int(mode) == 1 else 0)

    run = {"quantize_q8": quantize_q8, "mmvq_q8_0": mmvq}
    ops.kernel = lambda file, fn: (lambda grid, block, args: (launches.append(fn), run[fn](grid, block, args)))
    x = rng.standard_normal((n, cols)).astype(np.float32)
    r = rng.standard_normal((n, rows)).astype(np.float32)
    y = ops.mmvq(w, x, mode=1, r=r)
    assert launches == ["quantize_q8"] + ["mmvq_q8_0"] * 3  # 8 + 8 + 4 tokens
    want = x @ quants.dequantize(qw.raw, T.Q8_0).reshape(rows, cols).T + r
    assert np.abs(y - want).max() < 0.05 * np.abs(want).max()
