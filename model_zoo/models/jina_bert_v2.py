"""jina-bert-v2 (jina-embeddings-v2-small/base-en, jina-reranker-v1-turbo/tiny-en): bert's loop
with ALiBi (max_bias 8) in place of position embeddings, a GEGLU FFN (ffn_up holding gate and up
halves, or a separate ffn_gate in older files; with its biases), Q/K LayerNorms and a second
post-attention norm where the file has them, and a one-score classifier (cls, tanh-ed) on
rerankers. Reference: llama.cpp src/models/jina-bert-v2.cpp and bert.cpp's jina branches."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.encoder import Encoder, EncoderParams, build_encoder

MAX_ALIBI_BIAS = 8.0  # llama.cpp sets it for this architecture; no GGUF key holds it


@dataclass(frozen=True)
class Config(EncoderParams):
    pass


def _ffn(c: Config):
    e, n_ff = c.n_embd, c.n_ff

    def ffn(g, w, x, il):
        """llama.cpp's choice by ffn_up's rows: 2 * n_ff without ffn_gate is GEGLU over its halves
        (gate first); n_ff with ffn_gate, gelu(gate x) * up x; n_ff alone, gelu(up x)."""
        L = w.layer(il)
        n_up = (w.shape_of(f"blk.{il}.ffn_up.weight") or (2 * n_ff,))[0]  # the converter's layout when recording
        if n_up not in (n_ff, 2 * n_ff):
            raise ModelLoadError(f"tensor 'blk.{il}.ffn_up.weight' has {n_up} rows; jina-bert-v2 expects "
                                 f"{n_ff} or {2 * n_ff} (feed_forward_length {n_ff})")
        gate = L("ffn_gate.weight", (n_ff, e), optional=True) if n_up == n_ff else None
        up = g.mul_mat(L("ffn_up.weight", (n_up, e)), x, "ffn_up", il)  # (n_tokens, n_up)
        ub = L("ffn_up.bias", (n_up,), optional=True)
        up = up if ub is None else g.add(up, ub, "ffn_up_b", il)
        if n_up == 2 * n_ff:
            h = g.glu(g.slice(up, 0, n_ff, "ffn_gate_half", il), g.slice(up, n_ff, 2 * n_ff, "ffn_up_half", il),
                      "gelu", "ffn_geglu", il)
        elif gate is not None:
            h = g.glu(g.mul_mat(gate, x, "ffn_gate", il), up, "gelu", "ffn_geglu", il)
        else:
            h = g.gelu(up, "ffn_gelu", il)
        h = g.mul_mat(L("ffn_down.weight", (e, n_ff)), h, "ffn_down", il)
        return g.add(h, L("ffn_down.bias", (e,)), "ffn_down_b", il)
    return ffn


def build(c: Config, g, w, shape):
    return build_encoder(c, g, w, shape, Encoder(
        positions="alibi", alibi=MAX_ALIBI_BIAS, ffn=_ffn(c), qk_norm=True, cls_rows=1, cls_out=False,
        required=frozenset({"token_types.weight", "attn_output.bias"})))
