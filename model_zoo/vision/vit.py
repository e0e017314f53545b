"""The shared ViT blocks of the towers (llama.cpp tools/mtmd/clip.cpp's build_inp and build_vit):
patch embedding, learned positions, pre-norm layers of LayerNorm (with bias), attention with
no mask within each image, and an MLP; a projector file composes them. Tensor names as the
mmproj has them (v.blk.{il}.attn_q.weight, ...)."""
from __future__ import annotations

from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.model_zoo.blocks import build_layer_norm


def build_patches(c, g: Graph, w, *, n_images: int, height: int, width: int) -> tuple[Tensor, Tensor | None]:
    """Pixels (B, 3, H, W) -> patch embeddings (B * n_patches, n_embd) plus the learned positions
    (v.position_embd, one row per patch, read through the input "patch_pos"); and the image index
    of each patch ("seg", attention stays within an image) when more than one is encoded."""
    p, e = c.patch_size, c.n_embd
    n_patches = (height // p) * (width // p)
    pixels = g.input("pixels", (n_images, 3, height, width), F32)
    x = g.mul_mat(w("v.patch_embd.weight", (e, 3 * p * p)), g.patchify(pixels, p, "inp_patches"), "inp_embd")
    b = w("v.patch_embd.bias", (e,), optional=True)
    if b is not None:
        x = g.add(x, b, "patch_bias")
    pos = w("v.position_embd.weight", (n_patches, e), optional=True)
    if pos is not None:
        x = g.add(x, g.get_rows(pos, g.input("patch_pos", (n_images * n_patches,)), "pos_embd"), "inp_pos")
    seg = g.input("seg", (n_images * n_patches,)) if n_images > 1 else None
    return x, seg


def build_tower(c, g: Graph, w, shape, *, may_swap_ffn: bool = False, embed=None, rope=None,
                on_layer=None, body=None) -> Tensor:
    """The tower for `shape` (runtime.vision.ImageBatch) from the pixels to the last layer's output
    (post-LayerNorm'd where the file has it: the projector follows).
    `embed(c, g, w, n_images=, height=, width=) -> (x, seg)`: the patch embedding (build_patches by
    default); `rope(q, k, il) -> (q, k)`: RoPE inside attention (Qwen's 2D), where the tower has it;
    `on_layer(x, il)`: sees each layer's output (Qwen3-VL's deepstack taps); `body`: the layers in place
    of build_vit's (a tower of another layer kind, Gemma 4's), called as build_vit is."""
    x, seg = (embed or build_patches)(c, g, w, n_images=shape.n_images, height=shape.height, width=shape.width)
    return (body or build_vit)(c, g, w, x, seg=seg, may_swap_ffn=may_swap_ffn, layers=range(c.n_layer), rope=rope,
                               on_layer=on_layer)


def build_vit(c, g: Graph, w, x: Tensor, *, seg: Tensor | None, may_swap_ffn: bool = False,
              layers: range | None = None, rope=None, on_layer=None) -> Tensor:
    """The layers over patch embeddings x (n, n_embd) (`layers`: some of them), with the
    pre-LayerNorm before the first and the post-LayerNorm after the last where the file has them.
    may_swap_ffn: old mmproj files of some projectors (llama.cpp's is_ffn_swapped list) hold
    ffn_up and ffn_down swapped, told by ffn_down's shape. `rope`, `on_layer`: as build_tower's."""
    e, eps = c.n_embd, c.eps
    layers = range(c.n_layer) if layers is None else layers
    pre = w("v.pre_ln.weight", (e,), optional=True) if layers.start == 0 else None
    if pre is not None:
        x = build_layer_norm(g, x, pre, w("v.pre_ln.bias", (e,), optional=True), eps=eps, name="pre_ln")
    for il in layers:
        L = lambda name, shape, **kw: w(f"v.blk.{il}.{name}", shape, **kw)  # noqa: E731
        h = build_layer_norm(g, x, L("ln1.weight", (e,)), L("ln1.bias", (e,), optional=True), eps=eps,
                             name="ln1", il=il)
        fused = w.shape_of(f"v.blk.{il}.attn_qkv.weight") is not None
        x = g.add(x, build_attn_full(c, g, L, h, seg=seg, il=il, fused=fused, rope=rope), "ffn_inp", il)
        h = build_layer_norm(g, x, L("ln2.weight", (e,)), L("ln2.bias", (e,), optional=True), eps=eps,
                             name="ln2", il=il)
        swapped = may_swap_ffn and w.shape_of(f"v.blk.{il}.ffn_down.weight") == (c.n_ff, e)
        x = g.add(x, build_mlp(c, g, L, h, il=il, swapped=swapped), "layer_out", il)
        if on_layer is not None:
            on_layer(x, il)
    post = w("v.post_ln.weight", (e,), optional=True) if layers.stop == c.n_layer else None
    if post is not None:
        x = build_layer_norm(g, x, post, w("v.post_ln.bias", (e,), optional=True), eps=eps, name="post_ln")
    return x


def linear(g: Graph, L, name: str, x: Tensor, shape, il: int) -> Tensor:
    """x @ W.T (+ b where the file has {name}.bias)."""
    y = g.mul_mat(L(f"{name}.weight", shape), x, name, il)
    b = L(f"{name}.bias", (shape[0],), optional=True)
    return y if b is None else g.add(y, b, f"{name}_b", il)


def build_attn_full(c, g: Graph, L, h: Tensor, *, seg: Tensor | None, il: int, fused: bool = False,
                    rope=None) -> Tensor:
    """Attention with no mask within each image: Q, K, V from three projections or (`fused`) views
    of one attn_qkv (Q | K | V, Qwen's), rotated by `rope` where given."""
    e, hd, n = c.n_embd, c.head_dim, h.shape[0]
    nq, nk = c.n_head * hd, c.n_head_kv * hd
    if fused:
        qkv = linear(g, L, "attn_qkv", h, (nq + 2 * nk, e), il)
        q, k, v = (g.slice(qkv, lo, lo + m, name, il) for lo, m, name in ((0, nq, "Qcur_2d"), (nq, nk, "Kcur_2d"),
                                                                          (nq + nk, nk, "Vcur_2d")))
    else:
        q, k, v = (linear(g, L, name, h, (m, e), il) for name, m in (("attn_q", nq), ("attn_k", nk), ("attn_v", nk)))
    q = g.reshape(q, (n, c.n_head, hd), "Qcur", il)
    k = g.reshape(k, (n, c.n_head_kv, hd), "Kcur", il)
    v = g.reshape(v, (n, c.n_head_kv, hd), "Vcur", il)
    if rope is not None:
        q, k = rope(q, k, il)
    att = g.attn_full(q, k, v, scale=hd ** -0.5, seg=seg, name="kqv_out", il=il)
    return linear(g, L, "attn_out", att, (e, c.n_head * hd), il)


def build_mlp(c, g: Graph, L, h: Tensor, *, il: int, swapped: bool = False) -> Tensor:
    """up, the activation, down (biases where present)."""
    e, f = c.n_embd, c.n_ff
    up, down = ("ffn_down", "ffn_up") if swapped else ("ffn_up", "ffn_down")
    y = linear(g, L, up, h, (f, e), il)
    if c.act == "gelu":
        y = g.gelu(y, "ffn_gelu", il)
    elif c.act == "silu":
        y = g.silu(y, "ffn_silu", il)
    else:  # gelu_quick: x * sigmoid(1.702 x)
        y = g.mul(y, g.sigmoid(g.scale(y, 1.702, "ffn_quick_in", il), "ffn_quick_sig", il), "ffn_gelu_quick", il)
    return linear(g, L, down, y, (e, f), il)
