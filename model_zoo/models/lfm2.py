"""lfm2 (Liquid LFM2 / LFM2.5): a hybrid of gated short-convolution layers and GQA attention
layers (per-head Q/K norms, NeoX RoPE); every layer has the same SwiGLU FFN. The layer pattern
is the per-layer attention.head_count_kv array: 0 marks a conv layer, whose state is its last
l_cache - 1 inputs. Reference: llama.cpp src/models/lfm2.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.blocks import build_conv
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder


@dataclass(frozen=True)
class Config(HParams):
    l_cache: int = 3  # the conv's kernel width (shortconv.l_cache)
    NEOX = True

    @classmethod
    def read(cls, r: Reader) -> dict:
        l_cache = r.need("shortconv.l_cache")
        if l_cache < 2:
            raise ModelLoadError(f"GGUF metadata {r.key('shortconv.l_cache')!r} = {l_cache} must be at least 2")
        return dict(l_cache=l_cache)

    def has_attention(self, il: int) -> bool:
        return not self.head_count_kv_layers or self.head_count_kv_layers[il] > 0

    def window_of(self, il: int) -> int:
        return self.sliding_window

    def state_of(self, il: int) -> dict[str, tuple[int, ...]]:
        return {} if self.has_attention(il) else {"state_conv": (self.l_cache - 1, self.n_embd)}


def build_shortconv(c: Config, g, w, inp, h, il: int):
    """in_proj to B, C, x; the conv over B*x; C times that; out_proj. None on attention layers."""
    if c.has_attention(il):
        return None
    L, e = w.layer(il), c.n_embd
    bcx = g.mul_mat(L("shortconv.in_proj.weight", (3 * e, e)), h, "conv_in_proj", il)  # (n_tokens, 3 n_embd)
    bx = g.mul(g.slice(bcx, 0, e, "conv_b", il), g.slice(bcx, 2 * e, 3 * e, "conv_x", il), "conv_bx", il)
    y = build_conv(g, inp, bx, L("shortconv.conv.weight", (e, c.l_cache)), il=il)
    y = g.mul(g.slice(bcx, e, 2 * e, "conv_c", il), y, "conv_cy", il)
    return g.mul_mat(L("shortconv.out_proj.weight", (e, e)), y, "conv_out_proj", il)


def build(c: Config, g, w, shape, ffn=None):
    """`ffn(g, w, h, il)`: the FFN (lfm2moe's experts in later layers); attention layers may slide (LFM2.5)."""
    return build_decoder(c, g, w, shape, Decoder(
        mixer=lambda g, w, inp, h, il: build_shortconv(c, g, w, inp, h, il), ffn=ffn, qk_norm="head",
        out_norm=("token_embd_norm.weight", "output_norm.weight")))
