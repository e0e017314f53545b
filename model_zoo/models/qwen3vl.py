"""qwen3vl (Qwen3-VL's text model): qwen3 with interleaved M-RoPE (an image's rows at their grid
positions) and deepstack: an image's rows are 1 + n_deepstack_layers slices of n_embd, the first
its embedding, slice i + 1 added to layer i's output (text tokens add nothing there, as
llama.cpp pads their embeddings with zeros). Reference: llama.cpp src/models/qwen3vl.cpp."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.core.errors import ModelLoadError
from hearthlm.model_zoo.config import Reader
from hearthlm.model_zoo.decoder import Decoder, build_decoder
from hearthlm.model_zoo.models import qwen3


@dataclass(frozen=True)
class Config(qwen3.Config):
    n_deepstack: int = 0  # n_deepstack_layers: layers fed a slice of each image row
    MROPE = "imrope"

    @classmethod
    def read(cls, r: Reader) -> dict:
        n = r.get("n_deepstack_layers", 0, positive=False)
        if n > r.need("block_count"):
            raise ModelLoadError(f"{r.key('n_deepstack_layers')} {n} is more than the {r.need('block_count')} layers")
        return {**super().read(r), "n_deepstack": n}

    @property
    def n_embd_inp(self) -> int:
        """An image row's width: the embedding and one slice per deepstack layer."""
        return self.n_embd * (1 + self.n_deepstack)


def build(c: Config, g, w, shape):
    return build_decoder(c, g, w, shape, Decoder(qk_norm="head", deepstack=c.n_deepstack))
