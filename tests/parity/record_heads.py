"""Record llama.cpp's drafts from a model's own heads, once, as common/speculative.cpp's draft-mtp
makes them (greedy, every head token kept: p_min 0): for Gemma 4's assistant (a context of the
assistant with ctx_other = the target's, the target's unmasked nextn rows as its hidden input, every
draft token at the last token's position) and Qwen3.5's MTP block, dense and MoE (an LLAMA_CONTEXT_TYPE_MTP context of
the same model, fed each target batch's tokens with the target's rows shifted by one, process(); its
drafted cells removed before the target's next batch, as the server does). The target decodes a prompt
greedily, one token a step; before each step DRAFTS tokens are drafted from its state.
-> tests/data/converted/heads.json.
Run from the repo root with llama-cpp-python 0.3.36 (an oracle, never a dependency):
  python tests/parity/record_heads.py"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import llama_cpp as L
import llama_cpp.llama_cpp_ext as X
import numpy as np

DATA = Path(__file__).resolve().parents[2] / "tests/data/converted"
PROMPT = [2] + [5 + (i * 7) % 50 for i in range(30)]
STEPS, DRAFTS = 8, 4


def _ctx(model, other=None, kind=0):
    p = L.llama_context_default_params()
    p.ctx_type = kind
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 512, 512, 512, 1
    p.type_k = p.type_v = 1  # f16 K/V as hearthlm's default
    if other is not None:
        p.ctx_other = other
    return L.llama_init_from_model(model, p)


def _decode(ctx, tokens, pos0):
    b = L.llama_batch_init(len(tokens), 0, 1)
    b.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, pos0 + i, 1, 0, i == len(tokens) - 1
    assert L.llama_decode(ctx, b) == 0
    L.llama_batch_free(b)


def _row(ptr, n):
    return np.ctypeslib.as_array(ptr, shape=(n,)).copy()


def assistant(target: str, helper: str) -> dict:
    mp = L.llama_model_default_params()
    mt, ma = L.llama_model_load_from_file(target.encode(), mp), L.llama_model_load_from_file(helper.encode(), mp)
    ct = _ctx(mt)
    ca = _ctx(ma, ct)
    X.llama_set_embeddings_nextn(ct, True, False)
    X.llama_set_embeddings_nextn(ca, True, True)
    n_vocab, n_embd = L.llama_vocab_n_tokens(L.llama_model_get_vocab(mt)), L.llama_model_n_embd(mt)
    tokens, points = list(PROMPT), []
    _decode(ct, tokens, 0)
    h_at = len(tokens) - 1  # the batch row whose hidden state predicted the next token
    for _ in range(STEPS):
        tok = int(np.argmax(_row(L.llama_get_logits_ith(ct, -1), n_vocab)))
        tokens.append(tok)
        h = _row(X.llama_get_embeddings_nextn_ith(ct, h_at), n_embd)
        pos0, drafts, t = len(tokens) - 1, [], tok
        batch = L.llama_batch_ext_init(ca)
        for _ in range(DRAFTS):
            L.llama_batch_ext_clear(batch)
            idx = L.llama_batch_ext_add_token(batch, 0, t)
            pos = (ctypes.c_int32 * 4)(pos0, 0, 0, 0)
            L.llama_batch_ext_set_pos(batch, idx, pos)
            hh = np.ascontiguousarray(h, np.float32)
            assert L.llama_batch_ext_set_embd_token(batch, idx, L.llama_embd(hh.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd))
            L.llama_batch_ext_set_output_logits(batch, idx, True)
            assert L.llama_process(ca, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
            t = int(np.argmax(_row(L.llama_get_logits_ith(ca, 0), n_vocab)))
            drafts.append(t)
            h = _row(X.llama_get_embeddings_nextn_ith(ca, 0), n_embd)
        L.llama_batch_ext_free(batch)
        points.append(dict(tokens=list(tokens), drafts=drafts))
        _decode(ct, [tok], pos0)
        h_at = 0
    return dict(prompt=PROMPT, points=points)


def _mtp_batch(ctx, batch, rows, out_last):
    """rows: (token, pos, hidden row) decoded into the MTP context; logits of the last if out_last."""
    L.llama_batch_ext_clear(batch)
    keep = []
    for i, (t, p, h) in enumerate(rows):
        idx = L.llama_batch_ext_add_token(batch, 0, t)
        pos = (ctypes.c_int32 * 4)(p, 0, 0, 0)
        L.llama_batch_ext_set_pos(batch, idx, pos)
        hh = np.ascontiguousarray(h, np.float32)
        keep.append(hh)
        assert L.llama_batch_ext_set_embd_token(batch, idx, L.llama_embd(hh.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, len(hh)))
        if out_last and i == len(rows) - 1:
            L.llama_batch_ext_set_output_logits(batch, idx, True)
    assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0


def mtp(target: str) -> dict:
    mp = L.llama_model_default_params()
    mp.load_mtp = True  # the nextn block is skipped unless asked for
    mt = L.llama_model_load_from_file(target.encode(), mp)
    ct = _ctx(mt)
    cm = _ctx(mt, ct, kind=1)  # LLAMA_CONTEXT_TYPE_MTP
    X.llama_set_embeddings_nextn(ct, True, False)
    X.llama_set_embeddings_nextn(cm, True, True)
    n_vocab, n_embd = L.llama_vocab_n_tokens(L.llama_model_get_vocab(mt)), L.llama_model_n_embd(mt)
    batch = L.llama_batch_ext_init(cm)
    tokens, points = list(PROMPT), []
    _decode(ct, tokens, 0)
    hs = [_row(X.llama_get_embeddings_nextn_ith(ct, i), n_embd) for i in range(len(tokens))]
    # process(): token q with the target's row q - 1 (zeros before the first)
    _mtp_batch(cm, batch, [(t, q, hs[q - 1] if q else np.zeros(n_embd, np.float32)) for q, t in enumerate(tokens)], False)
    pending = hs[-1]
    for _ in range(STEPS):
        tok = int(np.argmax(_row(L.llama_get_logits_ith(ct, -1), n_vocab)))
        tokens.append(tok)
        pos0, drafts, t, h = len(tokens) - 1, [], tok, pending
        for i in range(DRAFTS):
            _mtp_batch(cm, batch, [(t, pos0 + i, h)], True)
            t = int(np.argmax(_row(L.llama_get_logits_ith(cm, 0), n_vocab)))
            drafts.append(t)
            h = _row(X.llama_get_embeddings_nextn_ith(cm, 0), n_embd)
        points.append(dict(tokens=list(tokens), drafts=drafts))
        assert L.llama_memory_seq_rm(L.llama_get_memory(cm), 0, pos0, -1)
        _decode(ct, [tok], pos0)
        _mtp_batch(cm, batch, [(tok, pos0, pending)], False)
        pending = _row(X.llama_get_embeddings_nextn_ith(ct, 0), n_embd)
    L.llama_batch_ext_free(batch)
    return dict(prompt=PROMPT, points=points)


if __name__ == "__main__":
    out = dict(llama_cpp_python=L.__version__,
               gemma4_assistant=assistant(str(DATA / "gemma4.gguf"), str(DATA / "drafts" / "gemma4-assistant.gguf")),
               qwen35_mtp=mtp(str(DATA / "qwen35.gguf")), qwen35moe_mtp=mtp(str(DATA / "qwen35moe.gguf")))
    (DATA / "heads.json").write_text(json.dumps(out))
    print(json.dumps(out)[:2000])
