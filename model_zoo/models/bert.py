"""bert (all-MiniLM, bge, mxbai, arctic-embed; bge-reranker with its classification head): a
bidirectional encoder with learned absolute positions, token-type embeddings, post-LayerNorms
with biases and a GELU FFN. Reference: llama.cpp src/models/bert.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.model_zoo.encoder import Encoder, EncoderParams, build_encoder


@dataclass(frozen=True)
class Config(EncoderParams):
    pass


def build(c: Config, g, w, shape):
    return build_encoder(c, g, w, shape, Encoder())
