"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head RMSNorm on Q and K, norms before and
after both attention and FFN, GeGLU (tanh GELU), NEOX RoPE, sliding-window attention on
five of every six layers (local RoPE base 10000), full attention on every sixth.
Reference: llama.cpp src/models/gemma3.cpp and its gemma3 hparams."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from hearthlm.model_zoo.blocks import (build_attn, build_ffn, build_inp_embd, build_inputs,
                                       build_norm, build_output)
from hearthlm.model_zoo.config import need, opt
from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.errors import ModelLoadError
from hearthlm.runtime.graph import Graph

SWA_PATTERN = 6           # layer il is local unless il % 6 == 5
LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float          # global (full-attention) layers
    rope_freq_scale: float    # global layers; local layers use 1.0
    sliding_window: int

    @classmethod
    def from_gguf(cls, md: Mapping[str, Any], arch: str = "gemma3") -> "Config":
        n_embd, n_head = need(md, f"{arch}.embedding_length"), need(md, f"{arch}.attention.head_count")
        factor = opt(md, f"{arch}.rope.scaling.factor", 1.0, float) if md.get(f"{arch}.rope.scaling.type") == "linear" else 1.0
        return cls(
            n_layer=need(md, f"{arch}.block_count"), n_embd=n_embd, n_head=n_head,
            n_head_kv=opt(md, f"{arch}.attention.head_count_kv", n_head),
            head_dim=opt(md, f"{arch}.attention.key_length", n_embd // n_head),
            n_ctx_train=need(md, f"{arch}.context_length"),
            norm_eps=opt(md, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, float),
            rope_base=opt(md, f"{arch}.rope.freq_base", 1e6, float), rope_freq_scale=1.0 / factor,
            sliding_window=opt(md, f"{arch}.attention.sliding_window", 0))

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ModelLoadError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")

    @property
    def kv_dims(self) -> tuple[int, int]:
        return self.n_head_kv, self.head_dim

    def is_local(self, il: int) -> bool:
        return self.sliding_window > 0 and il % SWA_PATTERN < SWA_PATTERN - 1


def build(cfg: Config, g: Graph, w, shape: BatchShape) -> None:
    inp = build_inputs(g, shape)
    x = build_inp_embd(g, w("token_embd.weight"), inp, scale=math.sqrt(cfg.n_embd))
    norm = dict(eps=cfg.norm_eps)
    for il in range(cfg.n_layer):
        local = cfg.is_local(il)
        h = build_norm(g, x, w(f"blk.{il}.attn_norm.weight"), name="attn_norm", il=il, **norm)
        h = build_attn(g, h, inp, il=il, wq=w(f"blk.{il}.attn_q.weight"), wk=w(f"blk.{il}.attn_k.weight"),
                       wv=w(f"blk.{il}.attn_v.weight"), wo=w(f"blk.{il}.attn_output.weight"),
                       n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, n_rot=cfg.head_dim,
                       rope_base=LOCAL_ROPE_BASE if local else cfg.rope_base,
                       rope_freq_scale=1.0 if local else cfg.rope_freq_scale, neox=True,
                       q_norm=w(f"blk.{il}.attn_q_norm.weight"), k_norm=w(f"blk.{il}.attn_k_norm.weight"),
                       norm_eps=cfg.norm_eps, window=cfg.sliding_window if local else 0,
                       scale=1.0 / math.sqrt(cfg.head_dim))
        h = build_norm(g, h, w(f"blk.{il}.post_attention_norm.weight"), name="attn_post_norm", il=il, **norm)
        x = g.add(x, h, "sa_out", il)
        h = build_norm(g, x, w(f"blk.{il}.ffn_norm.weight"), name="ffn_norm", il=il, **norm)
        h = build_ffn(g, h, il=il, gate=w(f"blk.{il}.ffn_gate.weight"), up=w(f"blk.{il}.ffn_up.weight"),
                      down=w(f"blk.{il}.ffn_down.weight"), act="gelu")
        h = build_norm(g, h, w(f"blk.{il}.post_ffw_norm.weight"), name="ffn_post_norm", il=il, **norm)
        x = g.add(x, h, "l_out", il)
    build_output(g, x, inp, norm=w("output_norm.weight"),
                 output=w("output.weight", fallback="token_embd.weight"), eps=cfg.norm_eps)
