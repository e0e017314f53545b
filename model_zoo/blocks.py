"""Shared building blocks that architecture files compose. Keyword arguments only past the
graph and the activation; every node is named (llama.cpp's `cb(cur, name, il)`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from hearthlm.runtime.batch import BatchShape
from hearthlm.runtime.graph import Graph, Tensor


@dataclass
class Inputs:
    tokens: Tensor       # (n_tokens,) token ids
    pos: Tensor          # (n_tokens,) position of each token in its sequence
    tok_seq: Tensor      # (n_tokens,) row of the token's sequence in block_table
    block_table: Tensor  # (n_seqs, max_blocks) KV block ids per sequence
    slots: Tensor        # (n_tokens,) KV slot each token's K/V is written to
    out_rows: Tensor     # (n_out,) tokens whose logits are wanted
    shape: BatchShape


def build_inputs(g: Graph, shape: BatchShape) -> Inputs:
    return Inputs(
        tokens=g.input("tokens", (shape.n_tokens,)),
        pos=g.input("pos", (shape.n_tokens,)),
        tok_seq=g.input("tok_seq", (shape.n_tokens,)),
        block_table=g.input("block_table", (shape.n_seqs, shape.max_blocks)),
        slots=g.input("slots", (shape.n_tokens,)),
        out_rows=g.input("out_rows", (shape.n_out,)),
        shape=shape,
    )


def build_inp_embd(g: Graph, tok_embd: Tensor, inp: Inputs, *, scale: float | None = None) -> Tensor:
    x = g.get_rows(tok_embd, inp.tokens, "inp_embd")  # (n_tokens, n_embd)
    return g.scale(x, scale, "inp_scaled") if scale is not None else x


def build_norm(g: Graph, x: Tensor, weight: Tensor, *, eps: float, name: str, il: int = -1) -> Tensor:
    """RMSNorm times its weight; fusion turns the pair into one op."""
    return g.mul(g.rms_norm(x, eps, f"{name}_rms", il), weight, name, il)


def build_attn(g: Graph, x: Tensor, inp: Inputs, *, il: int, wq: Tensor, wk: Tensor, wv: Tensor,
               wo: Tensor, n_head: int, n_head_kv: int, head_dim: int, n_rot: int, rope_base: float,
               rope_freq_scale: float = 1.0, neox: bool, q_norm: Tensor | None = None,
               k_norm: Tensor | None = None, norm_eps: float = 1e-6, window: int = 0,
               scale: float | None = None) -> Tensor:
    """Self-attention with GQA over the paged KV cache: project, (per-head norm), RoPE,
    write K/V into the cache, attend, project out."""
    n_tokens = x.shape[0]
    q = g.reshape(g.mul_mat(wq, x, "Qcur", il), (n_tokens, n_head, head_dim), "Qcur_3d", il)
    k = g.reshape(g.mul_mat(wk, x, "Kcur", il), (n_tokens, n_head_kv, head_dim), "Kcur_3d", il)
    v = g.reshape(g.mul_mat(wv, x, "Vcur", il), (n_tokens, n_head_kv, head_dim), "Vcur_3d", il)
    if q_norm is not None:
        q = build_norm(g, q, q_norm, eps=norm_eps, name="Qcur_normed", il=il)
    if k_norm is not None:
        k = build_norm(g, k, k_norm, eps=norm_eps, name="Kcur_normed", il=il)
    rope = dict(n_rot=n_rot, base=rope_base, freq_scale=rope_freq_scale, neox=neox)
    q = g.rope(q, inp.pos, name="Qcur_rope", il=il, **rope)
    k = g.rope(k, inp.pos, name="Kcur_rope", il=il, **rope)
    n_slots = inp.shape.n_slots
    k_cache = g.set_rows(g.cache("cache_k", (n_slots, n_head_kv, head_dim), il), k, inp.slots, "k_write", il)
    v_cache = g.set_rows(g.cache("cache_v", (n_slots, n_head_kv, head_dim), il), v, inp.slots, "v_write", il)
    att = build_kqv(g, q, k_cache, v_cache, inp, il=il, window=window,
                    scale=scale if scale is not None else 1.0 / math.sqrt(head_dim))
    return g.mul_mat(wo, att, "attn_out", il)  # (n_tokens, n_embd)


def build_kqv(g: Graph, q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: Inputs, *, il: int, scale: float,
              window: int = 0) -> Tensor:
    """softmax(q k^T * scale + mask) v over each token's own sequence, unfused: the K/V of
    each sequence gathered through its block table (n_kv = block-table width * block size).
    runtime.fusion turns the chain into one flash-attention op (Op.ATTN)."""
    bs = inp.shape.block_size
    k = g.gather_kv(k_cache, inp.block_table, block_size=bs, name="k_seq", il=il)  # (n_seqs, n_kv, h_kv, d)
    v = g.gather_kv(v_cache, inp.block_table, block_size=bs, name="v_seq", il=il)
    kq = g.scale(g.kq(q, k, inp.tok_seq, "kq", il), scale, "kq_scaled", il)  # (n_tokens, n_head, n_kv)
    mask = g.kq_mask(inp.pos, n_kv=k.shape[1], window=window, name="kq_mask", il=il)  # (n_tokens, 1, n_kv)
    probs = g.soft_max(g.add(kq, mask, "kq_masked", il), "kq_soft_max", il)
    out = g.kqv(probs, v, inp.tok_seq, "kqv", il)  # (n_tokens, n_head, dv)
    return g.reshape(out, (out.shape[0], out.shape[1] * out.shape[2]), "kqv_out", il)


def build_ffn(g: Graph, x: Tensor, *, il: int, gate: Tensor, up: Tensor, down: Tensor, act: str) -> Tensor:
    """Gated FFN: down(act(gate x) * up x); act is "silu" (SwiGLU) or "gelu" (GeGLU)."""
    g_ = g.mul_mat(gate, x, "ffn_gate", il)
    u = g.mul_mat(up, x, "ffn_up", il)
    a = g.silu(g_, "ffn_silu", il) if act == "silu" else g.gelu(g_, "ffn_gelu", il)
    return g.mul_mat(down, g.mul(a, u, "ffn_gate_par", il), "ffn_out", il)


def build_output(g: Graph, x: Tensor, inp: Inputs, *, norm: Tensor, output: Tensor, eps: float) -> Tensor:
    """Final norm and LM head on the output rows only (prefill tokens mostly need no logits).
    For steps with embedding requests, every token's normed hidden state is a second output."""
    hidden = x
    x = g.get_rows(x, inp.out_rows, "inp_out_ids")  # (n_out, n_embd)
    x = build_norm(g, x, norm, eps=eps, name="result_norm")
    logits = g.mul_mat(output, x, "result_output")  # (n_out, n_vocab)
    g.outputs.append(logits)
    if inp.shape.embd:  # second, after the logits
        g.outputs.append(build_norm(g, hidden, norm, eps=eps, name="result_embd"))  # (n_tokens, n_embd)
    return logits
