"""gemma-embedding (EmbeddingGemma-300M): Gemma 3's layers attending both ways (the sliding
layers over llama.cpp's symmetric window, |p - pos| <= window / 2), no LM head, and the
sentence-transformers dense projections (dense_2, dense_3) where the file has them. They are
affine, so they run on every token's state before pooling: the same as after it for mean,
first or last. Reference: llama.cpp src/models/gemma-embedding.cpp and build_dense_out."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder
from hearthlm.model_zoo.models import gemma3


@dataclass(frozen=True)
class Config(gemma3.Config):
    dense_2_out: int = 0  # dense_2's width (0: no dense layers)

    CAUSAL = False

    @classmethod
    def read(cls, r: Reader) -> dict:
        return dict(super().read(r), dense_2_out=r.get("dense_2_feat_out", 0, positive=False))


def _dense(c: Config):
    def project(g, w, h):
        e, n = c.n_embd, c.dense_2_out
        d2 = w("dense_2.weight", (n, e), optional=True) if n else None
        if d2 is None:
            return h
        h = g.mul_mat(d2, h, "dense_2")
        d3 = w("dense_3.weight", (e, n), optional=True)
        return h if d3 is None else g.mul_mat(d3, h, "dense_3")
    return project


def build(c: Config, g, w, shape):
    local_rope = dataclasses.replace(c.rope, base=c.rope_base_swa, scaling="none", freq_scale=1.0, factors=())
    return build_decoder(c, g, w, shape, Decoder(  # attention scale 1/sqrt(head_dim) whatever the depth
        rope=lambda il: local_rope if c.is_local(il) else c.rope,
        qk_norm="head", post_norm=True, act="gelu", embd_scale=math.sqrt(c.n_embd), embed_out=_dense(c)))
