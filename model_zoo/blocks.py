"""Shared building blocks that architecture files compose. Keyword arguments only past the
graph and the activation; every node is named (llama.cpp's `cb(cur, name, il)`)."""
from __future__ import annotations

from dataclasses import dataclass

from hearthlm.core.graph import F32, Graph, Tensor
from hearthlm.model_zoo.rope import Rope
from hearthlm.runtime.batch import BatchShape


@dataclass
class Inputs:
    tokens: Tensor       # (n_tokens,) token ids
    pos: Tensor          # (n_tokens,) position of each token in its sequence
    tok_seq: Tensor      # (n_tokens,) row of the token's sequence in block_table
    block_table: Tensor  # (n_seqs, max_blocks) KV block ids per sequence
    slots: Tensor        # (n_tokens,) KV slot each token's K/V is written to
    out_rows: Tensor     # (n_out,) tokens whose logits are wanted
    shape: BatchShape
    seq_off: Tensor | None = None     # (n_seqs + 1,) each sequence row's token range (hybrid models)
    state_slot: Tensor | None = None  # (n_seqs,) each row's recurrent-state slot (hybrid models)
    snap_slot: Tensor | None = None   # (n_tokens,) a slot the state after each token is also copied to, -1: none
    seq_len: Tensor | None = None     # (n_tokens,) the length of each token's sequence (encoders: non-causal);
                                      # causal with images: each token's horizon, its last visible position + 1
    causal: bool = True
    # (n_tokens, n_pos) M-RoPE's position components (t, h, w, e) of each token: (p, p, p, 0) for text,
    # an image's grid for its rows, later text shifted by what images take; `pos` stays the sequence
    # index (KV slot order) that masks read. None where the model's RoPE has one position.
    rope_pos: Tensor | None = None
    # (n_tokens, n_embd_inp) each token's image row (zeros for text) where the step has images and the rows
    # are wider than n_embd (Qwen3-VL's deepstack slices, added to early layers' outputs)
    media: Tensor | None = None


def build_inputs(g: Graph, shape: BatchShape, *, causal: bool = True, n_pos: int = 1) -> Inputs:
    """The step's inputs; causal=False (an encoder): attention sees each token's whole sequence;
    n_pos > 1: the "rope_pos" input of M-RoPE (model_zoo.rope.Rope.n_pos)."""
    inp = Inputs(
        tokens=g.input("tokens", (shape.n_tokens,)),
        pos=g.input("pos", (shape.n_tokens,)),
        tok_seq=g.input("tok_seq", (shape.n_tokens,)),
        block_table=g.input("block_table", (shape.n_seqs, shape.max_blocks)),
        slots=g.input("slots", (shape.n_tokens,)),
        out_rows=g.input("out_rows", (shape.n_out,)),
        shape=shape,
    )
    if shape.n_state:
        inp.seq_off = g.input("seq_off", (shape.n_seqs + 1,))
        inp.state_slot = g.input("state_slot", (shape.n_seqs,))
        inp.snap_slot = g.input("snap_slot", (shape.n_tokens,))
    if not causal or shape.n_media:
        inp.seq_len = g.input("seq_len", (shape.n_tokens,))
    if n_pos > 1:
        inp.rope_pos = g.input("rope_pos", (shape.n_tokens, n_pos))
    inp.causal = causal
    return inp


def build_state(g: Graph, inp: Inputs, name: str, shape: tuple[int, ...], *, il: int) -> Tensor:
    """A recurrent layer's state cache, (n_state_slots, *shape): runtime.seq_memory holds it."""
    assert inp.state_slot is not None, "a recurrent layer needs a batch shape with state slots"
    return g.cache(name, (inp.shape.n_state, *shape), il)


def build_conv(g: Graph, inp: Inputs, x: Tensor, w: Tensor, *, il: int, bias: Tensor | None = None,
               act: str | None = None, name: str = "conv") -> Tensor:
    """Causal depthwise conv over each sequence's tokens, its last K-1 inputs kept as the layer's
    state (LFM2's short conv; the conv before Mamba-2's scan and Qwen3.5's delta rule), then
    the bias and activation where the architecture has them. x (n_tokens, C), w (C, K)."""
    state = build_state(g, inp, "state_conv", (w.shape[1] - 1, x.shape[1]), il=il)
    y = g.ssm_conv(state, x, w, inp.seq_off, inp.state_slot, name=name, il=il, snap_slot=inp.snap_slot)
    if bias is not None:
        y = g.add(y, bias, f"{name}_b", il)
    return g.silu(y, f"{name}_silu", il) if act == "silu" else y


def build_inp_embd(g: Graph, tok_embd: Tensor, inp: Inputs, *, scale: float | None = None,
                   n_embd_inp: int | None = None) -> Tensor:
    """Token embeddings (times `scale`); where the step has images, their rows in place of the
    placeholder tokens' (unscaled, as llama.cpp takes embeddings input): "media_rows" holds them
    after a zero row, "media_at" each token's row there (0: a token), "text_mask" 1 for a token.
    `n_embd_inp`: the rows' width where wider than the embeddings (the first n_embd are the
    embedding; inp.media keeps the whole rows, build_deepstack reads the rest)."""
    x = g.get_rows(tok_embd, inp.tokens, "inp_embd")  # (n_tokens, n_embd)
    x = g.scale(x, scale, "inp_scaled") if scale is not None else x
    n, m, e = inp.shape.n_tokens, inp.shape.n_media, tok_embd.shape[1]
    if not m:
        return x
    rows = g.input("media_rows", (m, n_embd_inp or e), F32)
    text = g.mul(x, g.input("text_mask", (n, 1), F32), "inp_text")
    img = g.get_rows(rows, g.input("media_at", (n,)), "inp_media")  # (n_tokens, n_embd_inp)
    if img.shape[1] > e:
        inp.media, img = img, g.slice(img, 0, e, "inp_media_embd")
    return g.add(text, img, "inp_spliced")


def build_deepstack(g: Graph, x: Tensor, inp: Inputs, *, il: int) -> Tensor:
    """x plus slice il + 1 of each token's image row (Qwen3-VL's deepstack; text tokens' rows are
    zeros); x itself where the step has no images."""
    if inp.media is None:
        return x
    e = x.shape[1]
    return g.add(x, g.slice(inp.media, (il + 1) * e, (il + 2) * e, "deepstack", il), "deepstack_out", il)


def build_norm(g: Graph, x: Tensor, weight: Tensor, *, eps: float, name: str, il: int = -1) -> Tensor:
    """RMSNorm times its weight; fusion turns the pair into one op."""
    return g.mul(g.rms_norm(x, eps, f"{name}_rms", il), weight, name, il)


def build_layer_norm(g: Graph, x: Tensor, weight: Tensor, bias: Tensor | None, *, eps: float, name: str,
                     il: int = -1) -> Tensor:
    """LayerNorm (ggml_norm, then weight and bias): the RMSNorm of x less its mean."""
    n = x.shape[-1]
    centred = g.add(x, g.scale(g.sum_rows(x, f"{name}_sum", il), -1.0 / n, f"{name}_mean", il), f"{name}_centred", il)
    y = build_norm(g, centred, weight, eps=eps, name=name, il=il)
    return y if bias is None else g.add(y, bias, f"{name}_b", il)


def build_qkv(g: Graph, x: Tensor, *, il: int, n_head: int, n_head_kv: int, head_dim: int,
              wq: Tensor | None = None, wk: Tensor | None = None, wv: Tensor | None = None,
              wqkv: Tensor | None = None, bq: Tensor | None = None, bk: Tensor | None = None,
              bv: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V as (n_tokens, heads, head_dim): three projections (each with an optional bias),
    or one fused `wqkv` whose output columns are viewed as Q | K | V (llama.cpp's build_qkv)."""
    n_tokens = x.shape[0]
    nq, nk = n_head * head_dim, n_head_kv * head_dim
    qkv = g.mul_mat(wqkv, x, "wqkv", il) if wqkv is not None else None  # (n_tokens, nq + 2 nk)
    out = []
    for w_, b, h, lo, n in ((wq, bq, n_head, 0, "Qcur"), (wk, bk, n_head_kv, nq, "Kcur"),
                            (wv, bv, n_head_kv, nq + nk, "Vcur")):
        t = g.mul_mat(w_, x, n, il) if qkv is None else g.slice(qkv, lo, lo + h * head_dim, n, il)
        if b is not None:
            t = g.add(t, b, f"{n}_b", il)
        out.append(g.reshape(t, (n_tokens, h, head_dim), f"{n}_3d", il))
    return out[0], out[1], out[2]


def build_rope(g: Graph, x: Tensor, inp: Inputs, rope: Rope, *, name: str, il: int) -> Tensor:
    """RoPE on (n_tokens, heads, head_dim) with the model's scaling (see model_zoo.rope); M-RoPE
    turns by the position components (inp.rope_pos), not the sequence index."""
    p = rope.params()
    assert "comps" not in p or inp.rope_pos is not None, f"{name}: M-RoPE needs build_inputs(n_pos=...)"
    return g.rope(x, inp.rope_pos if "comps" in p else inp.pos, name=name, il=il, **p)


def build_qk_norm_rope(g: Graph, q: Tensor, k: Tensor, inp: Inputs, rope: Rope | None, *, il: int,
                       q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                       eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """Per-head Q/K RMSNorm where the architecture has it (Qwen3, Gemma 3), then RoPE on both
    (rope None: a layer without, as SmolLM3's every fourth)."""
    if q_norm is not None:
        q = build_norm(g, q, q_norm, eps=eps, name="Qcur_normed", il=il)
        k = build_norm(g, k, k_norm, eps=eps, name="Kcur_normed", il=il)
    if rope is None:
        return q, k
    return build_rope(g, q, inp, rope, name="Qcur_rope", il=il), build_rope(g, k, inp, rope, name="Kcur_rope", il=il)


def build_residual(g: Graph, x: Tensor, h: Tensor, *, name: str, il: int, post_norm: Tensor | None = None,
                   post_name: str = "", eps: float = 0.0) -> Tensor:
    """x + h, h RMS-normed first where the architecture has a post-norm (Gemma 2 and 3)."""
    if post_norm is not None:
        h = build_norm(g, h, post_norm, eps=eps, name=post_name, il=il)
    return g.add(x, h, name, il)


def build_attn(g: Graph, inp: Inputs, q: Tensor, k: Tensor, v: Tensor, *, il: int, wo: Tensor | None,
               bo: Tensor | None = None, scale: float, window: int = 0, softcap: float = 0.0,
               alibi: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """The attention core (llama.cpp's build_attn on Qcur/Kcur/Vcur): K and V, already
    projected (and K rotated), are written into the paged cache; each token attends over its
    own sequence; the output projection follows (wo=None: the caller's, after a gate, say).
    q (n_tokens, n_head, d), k/v (n_tokens, h_kv, d); alibi: ggml's max_bias (ALiBi, jina-bert-v2);
    sinks (n_head,): a logit per head that takes its share of each softmax (gpt-oss)."""
    n_slots = inp.shape.n_slots
    k_cache = g.set_rows(g.cache("cache_k", (n_slots, *k.shape[1:]), il), k, inp.slots, "k_write", il)
    v_cache = g.set_rows(g.cache("cache_v", (n_slots, *v.shape[1:]), il), v, inp.slots, "v_write", il)
    att = build_kqv(g, q, k_cache, v_cache, inp, il=il, window=window, scale=scale, softcap=softcap, alibi=alibi,
                    sinks=sinks)
    if wo is None:
        return att  # (n_tokens, n_head * dv)
    out = g.mul_mat(wo, att, "attn_out", il)  # (n_tokens, n_embd)
    return out if bo is None else g.add(out, bo, "attn_out_b", il)


def build_kqv(g: Graph, q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: Inputs, *, il: int, scale: float,
              window: int = 0, softcap: float = 0.0, alibi: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """softmax(q k^T * scale + mask) v over each token's own sequence, unfused: the K/V of
    each sequence gathered through its block table (n_kv = block-table width * block size).
    runtime.fusion turns the chain into one flash-attention op (Op.ATTN)."""
    bs = inp.shape.block_size
    k = g.gather_kv(k_cache, inp.block_table, block_size=bs, name="k_seq", il=il)  # (n_seqs, n_kv, h_kv, d)
    v = g.gather_kv(v_cache, inp.block_table, block_size=bs, name="v_seq", il=il)
    kq = g.scale(g.kq(q, k, inp.tok_seq, "kq", il), scale, "kq_scaled", il)  # (n_tokens, n_head, n_kv)
    if softcap:  # softcap * tanh(kq / softcap) (Gemma 2); the chain stays unfused
        kq = g.scale(g.tanh(g.scale(kq, 1.0 / softcap, "kq_scaled_1", il), "kq_tanh", il), softcap, "kq_scaled_2", il)
    mask = g.kq_mask(inp.pos, n_kv=k.shape[1], window=window, seq_len=inp.seq_len, alibi=alibi, n_head=q.shape[1],
                     causal=inp.causal, name="kq_mask", il=il)  # (n_tokens, 1, n_kv); with ALiBi (n_tokens, n_head, n_kv)
    probs = g.soft_max(g.add(kq, mask, "kq_masked", il), "kq_soft_max", il, sinks=sinks)
    out = g.kqv(probs, v, inp.tok_seq, "kqv", il)  # (n_tokens, n_head, dv)
    return g.reshape(out, (out.shape[0], out.shape[1] * out.shape[2]), "kqv_out", il)


def build_ffn(g: Graph, x: Tensor, *, il: int, gate: Tensor, up: Tensor, down: Tensor, act: str) -> Tensor:
    """Gated FFN: down(act(gate x) * up x); act is "silu" (SwiGLU) or "gelu" (GeGLU)."""
    g_ = g.mul_mat(gate, x, "ffn_gate", il)
    u = g.mul_mat(up, x, "ffn_up", il)
    a = g.silu(g_, "ffn_silu", il) if act == "silu" else g.gelu(g_, "ffn_gelu", il)
    return g.mul_mat(down, g.mul(a, u, "ffn_gate_par", il), "ffn_out", il)


def build_output(g: Graph, x: Tensor, inp: Inputs, *, norm: Tensor, output: Tensor, eps: float,
                 softcap: float = 0.0) -> Tensor:
    """Final norm and LM head on the output rows only (prefill tokens mostly need no logits);
    `softcap`: logits = softcap * tanh(logits / softcap) (Gemma 2). Returns the logits (the
    architecture may scale them; the model makes them the graph's first output). For steps with
    embedding requests, every token's normed hidden state is registered as an output here."""
    hidden = x
    x = g.get_rows(x, inp.out_rows, "inp_out_ids")  # (n_out, n_embd)
    x = build_norm(g, x, norm, eps=eps, name="result_norm")
    logits = g.mul_mat(output, x, "result_output")  # (n_out, n_vocab)
    if softcap:
        logits = g.scale(g.tanh(g.scale(logits, 1.0 / softcap, "result_scaled_1"), "result_tanh"), softcap,
                         "result_softcapped")
    if inp.shape.embd:  # after the logits
        g.outputs.append(build_norm(g, hidden, norm, eps=eps, name="result_embd"))  # (n_tokens, n_embd)
    return logits


def moe_weights(w, il: int, *, n_expert: int, n_embd: int, n_ff: int) -> dict[str, Tensor]:
    """Layer il's router and stacked experts (n_ff wide) under their GGUF names, as build_moe_ffn takes them."""
    L = w.layer(il)
    return dict(gate_inp=L("ffn_gate_inp.weight", (n_expert, n_embd)),
                up_exps=L("ffn_up_exps.weight", (n_expert, n_ff, n_embd)),
                gate_exps=L("ffn_gate_exps.weight", (n_expert, n_ff, n_embd)),
                down_exps=L("ffn_down_exps.weight", (n_expert, n_embd, n_ff)))


def build_moe_ffn(g: Graph, x: Tensor, *, il: int, gate_inp: Tensor | None, up_exps: Tensor | None,
                  gate_exps: Tensor | None, down_exps: Tensor, n_expert_used: int, norm_w: bool = True,
                  gating: str = "softmax", probs_bias: Tensor | None = None, w_scale: float = 0.0, act: str = "silu",
                  gate_inp_b: Tensor | None = None, up_b: Tensor | None = None, gate_b: Tensor | None = None,
                  down_b: Tensor | None = None, logits: Tensor | None = None, gate_up_exps: Tensor | None = None,
                  down_s: Tensor | None = None) -> Tensor:
    """Mixture of experts as llama.cpp's build_moe_ffn (gated experts, SwiGLU or gpt-oss's clamped
    "swiglu_oai"): the router's softmax (or sigmoid; "softmax_weight": the raw logits choose and
    the chosen ones' softmax weighs, as gpt-oss), the top n_expert_used experts per token (chosen
    by probability plus `probs_bias` where given, as LFM2-MoE's) weighted by their probabilities
    (renormalized over the chosen ones with norm_w, then times w_scale where set), their outputs
    summed. Biases (router, and per expert: E rows of each projection's width) where given.
    Gemma 4's: `logits` the caller's router (gate_inp None), `gate_up_exps` the experts' gate and up
    rows fused (E, 2 * n_ff, n_embd: gate first), `down_s` a scale per expert on its output (E,)."""
    n_tokens, n_embd = x.shape
    if logits is None:
        logits = g.mul_mat(gate_inp, x, "ffn_moe_logits", il)  # (n_tokens, n_expert)
    if gate_inp_b is not None:
        logits = g.add(logits, gate_inp_b, "ffn_moe_logits_biased", il)
    probs = (g.soft_max(logits, "ffn_moe_probs", il) if gating == "softmax"
             else logits if gating == "softmax_weight" else g.sigmoid(logits, "ffn_moe_probs", il))
    select = probs if probs_bias is None else g.add(probs, probs_bias, "ffn_moe_probs_biased", il)
    ids = g.top_k(select, n_expert_used, "ffn_moe_topk", il)  # (n_tokens, k)
    w = g.take(probs, ids, "ffn_moe_weights", il)  # (n_tokens, k)
    if gating == "softmax_weight":
        w = g.soft_max(w, "ffn_moe_weights_softmax", il)
    flat_ids = (g.reshape(ids, (n_tokens * n_expert_used,), "ffn_moe_topk_flat", il)
                if any(b is not None for b in (up_b, gate_b, down_b)) else None)

    def expert_bias(t: Tensor, b: Tensor | None, name: str) -> Tensor:  # ggml_add_id: each chosen expert's row
        if b is None:
            return t
        rows = g.reshape(g.get_rows(b, flat_ids, f"{name}_rows", il), t.shape, f"{name}_rows_3d", il)
        return g.add(t, rows, f"{name}_biased", il)
    if norm_w:  # llama.cpp clamps the sum at 6.1e-5: a softmax's top-k sum is >= k / n_expert, and
        # the sigmoid routers' top-k sums are far above it
        w = g.div(w, g.sum_rows(w, "ffn_moe_weights_sum", il), "ffn_moe_weights_norm", il)
    if w_scale not in (0.0, 1.0):
        w = g.scale(w, w_scale, "ffn_moe_weights_scaled", il)
    if down_s is not None:  # ggml scales each expert's down output; the same product, on k weights per token
        s = g.get_rows(g.reshape(down_s, (down_s.shape[0], 1), "ffn_moe_down_s_2d", il),
                       g.reshape(ids, (n_tokens * n_expert_used,), "ffn_moe_topk_flat", il), "ffn_moe_down_s", il)
        w = g.mul(w, g.reshape(s, (n_tokens, n_expert_used), "ffn_moe_down_s_rows", il), "ffn_moe_weights_s", il)
    if gate_up_exps is not None:  # one product, then the gate and up halves
        gu = g.mul_mat_id(gate_up_exps, x, ids, "ffn_moe_gate_up", il)  # (n_tokens, k, 2 * n_ff_exp)
        f = gu.shape[-1] // 2
        gate, up = g.slice(gu, 0, f, "ffn_moe_gate", il), g.slice(gu, f, 2 * f, "ffn_moe_up", il)
    else:
        up = expert_bias(g.mul_mat_id(up_exps, x, ids, "ffn_moe_up", il), up_b, "ffn_moe_up")  # (n_tokens, k, n_ff_exp)
        gate = expert_bias(g.mul_mat_id(gate_exps, x, ids, "ffn_moe_gate", il), gate_b, "ffn_moe_gate")
    a = g.glu(gate, up, act, "ffn_moe_swiglu", il)
    experts = expert_bias(g.mul_mat_id(down_exps, a, ids, "ffn_moe_down", il), down_b, "ffn_moe_down")  # (n_tokens, k, n_embd)
    experts = g.mul(experts, g.reshape(w, (n_tokens, n_expert_used, 1), "ffn_moe_weights_3d", il),
                    "ffn_moe_weighted", il)
    flat = g.reshape(experts, (n_tokens, n_expert_used * n_embd), "ffn_moe_flat", il)
    out = g.slice(flat, 0, n_embd, "ffn_moe_exp_0", il)
    for i in range(1, n_expert_used):  # views, then adds (fusion makes one add_n)
        out = g.add(out, g.slice(flat, i * n_embd, (i + 1) * n_embd, f"ffn_moe_exp_{i}", il), "ffn_moe_out", il)
    return out
