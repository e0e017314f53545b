"""llama (and SmolLM2, Mistral-style GQA models): pre-norm, RoPE (normal mode), SwiGLU.
Reference: llama.cpp src/models/llama.cpp."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hearthlm.model_zoo.blocks import (build_attn, build_ffn, build_inp_embd, build_inputs,
                                       build_norm, build_output)
from hearthlm.model_zoo.config import need, opt
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.errors import ModelLoadError
from hearthlm.runtime.graph import Graph


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_freq_scale: float

    @classmethod
    def from_gguf(cls, md: Mapping[str, Any], arch: str = "llama") -> "Config":
        n_embd, n_head = need(md, f"{arch}.embedding_length"), need(md, f"{arch}.attention.head_count")
        head_dim = opt(md, f"{arch}.attention.key_length", n_embd // n_head)
        scaling = opt(md, f"{arch}.rope.scaling.factor", 1.0, float) if md.get(f"{arch}.rope.scaling.type") == "linear" else 1.0
        return cls(
            n_layer=need(md, f"{arch}.block_count"), n_embd=n_embd, n_head=n_head,
            n_head_kv=opt(md, f"{arch}.attention.head_count_kv", n_head), head_dim=head_dim,
            n_rot=opt(md, f"{arch}.rope.dimension_count", head_dim),
            n_ctx_train=need(md, f"{arch}.context_length"),
            norm_eps=opt(md, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_base=opt(md, f"{arch}.rope.freq_base", 10000.0, float), rope_freq_scale=1.0 / scaling)

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ModelLoadError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")

    @property
    def kv_dims(self) -> tuple[int, int]:  # (n_head_kv, head_dim) of each layer's cache
        return self.n_head_kv, self.head_dim

    def layer_window(self, il: int) -> int:
        return 0


def build(cfg: Config, g: Graph, w, shape: BatchShape) -> None:
    """Adds the forward pass to `g`; `w(name)` returns the weight node for a GGUF tensor name."""
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp)
    for il in range(cfg.n_layer):
        h = build_norm(g, x, w(f"blk.{il}.attn_norm.weight"), eps=cfg.norm_eps, name="attn_norm", il=il)
        h = build_attn(g, h, inp, il=il, wq=w(f"blk.{il}.attn_q.weight"), wk=w(f"blk.{il}.attn_k.weight"),
                       wv=w(f"blk.{il}.attn_v.weight"), wo=w(f"blk.{il}.attn_output.weight"),
                       n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                       n_rot=cfg.n_rot, rope_base=cfg.rope_base, rope_freq_scale=cfg.rope_freq_scale,
                       neox=False)
        x = g.add(x, h, "ffn_inp", il)
        h = build_norm(g, x, w(f"blk.{il}.ffn_norm.weight"), eps=cfg.norm_eps, name="ffn_norm", il=il)
        h = build_ffn(g, h, il=il, gate=w(f"blk.{il}.ffn_gate.weight"), up=w(f"blk.{il}.ffn_up.weight"),
                      down=w(f"blk.{il}.ffn_down.weight"), act="silu")
        x = g.add(x, h, "l_out", il)
    build_output(g, x, inp, norm=w("output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=cfg.norm_eps)
