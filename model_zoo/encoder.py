"""The shared layer loop of BERT-style encoders (llama.cpp src/models/bert.cpp, which builds
bert, nomic-bert and jina-bert-v2 alike): embeddings (+ token type 0, + absolute positions)
LayerNorm-ed, then per layer bidirectional attention (positions: absolute, RoPE or ALiBi) and an
FFN, each followed by a residual add and a LayerNorm (post-norm). No LM head: the graph's first
output is the classification head (a reranker's score) at the output rows where the file has
one, else their hidden state; every token's hidden state is the second (what embeddings pool)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hearthlm.core.graph import Graph, Tensor
from hearthlm.model_zoo.blocks import build_attn, build_ffn, build_inputs, build_layer_norm, build_qk_norm_rope, build_qkv
from hearthlm.model_zoo.config import HParams, Reader
from hearthlm.runtime.batch import BatchShape


@dataclass(frozen=True)
class EncoderParams(HParams):
    """What encoders read beyond HParams: LayerNorm's epsilon, the token-type count (a tokenizer
    key), the reranker head's width (one score per classifier.output_labels entry, else 1)."""
    n_token_types: int = 2
    n_cls_out: int = 1

    CAUSAL = False  # the engine runs each input whole, attending both ways

    @classmethod
    def from_gguf(cls, md: Mapping[str, Any], arch: str) -> "EncoderParams":
        c = super().from_gguf(md, arch)
        return dataclasses.replace(c, norm_eps=Reader(md, arch).opt("attention.layer_norm_epsilon", 1e-12, float))

    @classmethod
    def read(cls, r: Reader) -> dict:
        labels = r.md.get(r.key("classifier.output_labels"))
        return dict(n_token_types=int(r.md.get("tokenizer.ggml.token_type_count", 2)),
                    n_cls_out=len(labels) if labels is not None and len(labels) else 1)


@dataclass(frozen=True)
class Encoder:
    positions: str = "abs"   # "abs": learned embeddings (BERT); "rope" (nomic-bert); "alibi" (jina-bert-v2)
    alibi: float = 0.0       # ALiBi's max_bias (llama.cpp's f_max_alibi_bias)
    fused_qkv: bool = False  # one attn_qkv projection (nomic-bert)
    glu: bool = False        # SwiGLU FFN, no biases (nomic-bert); else up -> GELU -> down with biases
    ffn: Callable | None = None  # (g, w, x, il) -> FFN output: an architecture's own (jina-bert-v2's GEGLU)
    qk_norm: bool = False    # LayerNorms over the Q and K rows, and a second post-attention norm,
                             # where the file has them (jina-bert-v2)
    required: frozenset = frozenset()  # tensors (layer-relative) this architecture needs where bert's are optional
    cls_rows: int = 0        # rows of cls.weight: 0 is n_embd (bert's dense + tanh); 1: jina's one score
    cls_out: bool = True     # reads cls.output (bert); jina-bert-v2's head is cls alone


def build_encoder(c: EncoderParams, g: Graph, w, shape: BatchShape, d: Encoder = Encoder()) -> Tensor:
    e, eps, hd = c.n_embd, c.norm_eps, c.head_dim
    inp = build_inputs(g, shape, causal=False)
    x = g.get_rows(w("token_embd.weight", (w.n_vocab, e)), inp.tokens, "inp_embd")  # (n_tokens, n_embd)
    type0 = w("token_types.weight", (c.n_token_types, e), optional="token_types.weight" not in d.required,
              rows=(0, 1), flat=True)
    if type0 is not None:  # every token is of type 0 ("sentence A"), as llama.cpp has it
        x = g.add(x, type0, "inp_typed")
    if d.positions == "abs":
        x = g.add(x, g.get_rows(w("position_embd.weight", (c.n_ctx_train, e)), inp.pos, "inp_pos_embd"), "inp_embd_pos")
    x = build_layer_norm(g, x, w("token_embd_norm.weight", (e,)), w("token_embd_norm.bias", (e,)), eps=eps,
                         name="inp_norm")
    nq, nkv = c.n_head * hd, c.n_head_kv * hd
    for il in range(c.n_layer):
        L = w.layer(il)
        b = lambda name, n: L(f"{name}.bias", (n,), optional=f"{name}.bias" not in d.required)  # noqa: E731
        proj = (dict(wqkv=L("attn_qkv.weight", (nq + 2 * nkv, e))) if d.fused_qkv else
                dict(wq=L("attn_q.weight", (nq, e)), wk=L("attn_k.weight", (nkv, e)), wv=L("attn_v.weight", (nkv, e)),
                     bq=b("attn_q", nq), bk=b("attn_k", nkv), bv=b("attn_v", nkv)))
        q, k, v = build_qkv(g, x, il=il, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=hd, **proj)
        if d.qk_norm:  # LayerNorm over each token's whole Q (K) row, as llama.cpp reshapes to 2-D for it
            q = _row_norm(g, q, L("attn_q_norm.weight", (nq,), optional=True), b("attn_q_norm", nq), eps, "Qcur", il)
            k = _row_norm(g, k, L("attn_k_norm.weight", (nkv,), optional=True), b("attn_k_norm", nkv), eps, "Kcur", il)
        q, k = build_qk_norm_rope(g, q, k, inp, c.rope if d.positions == "rope" else None, il=il)
        h = build_attn(g, inp, q, k, v, il=il, wo=L("attn_output.weight", (e, nq)), bo=b("attn_output", e),
                       scale=1.0 / math.sqrt(hd), alibi=d.alibi if d.positions == "alibi" else 0.0)
        res = x
        x = build_layer_norm(g, g.add(h, x, "attn_res", il), L("attn_output_norm.weight", (e,)),
                             L("attn_output_norm.bias", (e,)), eps=eps, name="attn_out_norm", il=il)
        n2 = L("attn_norm_2.weight", (e,), optional=True) if d.qk_norm else None
        if n2 is not None:  # the layer input added again, and normed again
            x = build_layer_norm(g, g.add(x, res, "attn_res_2", il), n2, b("attn_norm_2", e), eps=eps,
                                 name="attn_norm_2", il=il)
        if d.ffn is not None:
            h = d.ffn(g, w, x, il)
        elif d.glu:
            h = build_ffn(g, x, il=il, gate=L("ffn_gate.weight", (c.n_ff, e)), up=L("ffn_up.weight", (c.n_ff, e)),
                          down=L("ffn_down.weight", (e, c.n_ff)), act="silu")
        else:  # up (+ bias), GELU, down (+ bias): llama.cpp's LLM_FFN_GELU, LLM_FFN_SEQ
            h = _add_bias(g, g.mul_mat(L("ffn_up.weight", (c.n_ff, e)), x, "ffn_up", il), b("ffn_up", c.n_ff), il)
            h = g.mul_mat(L("ffn_down.weight", (e, c.n_ff)), g.gelu(h, "ffn_gelu", il), "ffn_down", il)
            h = _add_bias(g, h, b("ffn_down", e), il)
        x = build_layer_norm(g, g.add(h, x, "ffn_res", il), L("layer_output_norm.weight", (e,)),
                             L("layer_output_norm.bias", (e,)), eps=eps, name="layer_out_norm", il=il)
    return build_encoder_output(g, w, x, inp.out_rows, e=e, n_cls_out=c.n_cls_out, embd=shape.embd,
                                cls_rows=d.cls_rows or e, cls_out=d.cls_out)


def _row_norm(g: Graph, t: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, name: str,
              il: int) -> Tensor:
    """LayerNorm over (n_tokens, heads, head_dim) rows taken whole, where the file has the norm."""
    if weight is None:
        return t
    n, h, hd = t.shape
    y = build_layer_norm(g, g.reshape(t, (n, h * hd), f"{name}_2d", il), weight, bias, eps=eps,
                         name=f"{name}_norm", il=il)
    return g.reshape(y, (n, h, hd), f"{name}_normed", il)


def _add_bias(g: Graph, x: Tensor, bias: Tensor | None, il: int) -> Tensor:
    return x if bias is None else g.add(x, bias, f"{x.name}_b", il)


def build_encoder_output(g: Graph, w, x: Tensor, out_rows: Tensor, *, e: int, n_cls_out: int, embd: bool,
                         cls_rows: int = 0, cls_out: bool = True) -> Tensor:
    """At the output rows (a reranker's [CLS] token), the classification head where the file has
    one (cls: dense + tanh; cls.output: the scores, llama.cpp's rank pooling), else the hidden state.
    cls_rows: cls.weight's rows (n_embd; jina-bert-v2's is one score, tanh-ed as llama.cpp does)."""
    h = g.get_rows(x, out_rows, "inp_out_ids")  # (n_out, n_embd)
    cls_rows = cls_rows or e
    cls = w("cls.weight", (cls_rows, e), optional=True)
    cls_out = w("cls.output.weight", (n_cls_out, e), optional=True) if cls_out else None
    if cls is not None:
        h = g.mul_mat(cls, h, "cls")
        cb = w("cls.bias", (cls_rows,), optional=True)
        h = g.tanh(h if cb is None else g.add(h, cb, "cls_b"), "cls_tanh")
    if cls_out is not None:
        h = g.mul_mat(cls_out, h, "cls_out")
        ob = w("cls.output.bias", (n_cls_out,), optional=True)
        h = h if ob is None else g.add(h, ob, "cls_out_b")
    if embd:
        g.outputs.append(x)  # (n_tokens, n_embd): what embeddings pool
    return h
