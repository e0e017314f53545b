"""Run by tests/parity/record.py under a Python with llama-cpp-python (never in CI): greedy
steps and top-5 log-probs of llama.cpp on the given GGUFs. argv: a JSON list of
{"name", "path", "prompts", "n_steps"}; prints the results as JSON."""
import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

POOL = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
        "last": llama_cpp.LLAMA_POOLING_TYPE_LAST, "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK}


def run(path: str, prompts: list[list[int]], n_steps: int, loras=(), **kw) -> list[dict]:
    """`loras`: [(adapter path, scale), ...] set on the context (llama_set_adapters_lora)."""
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=256, logits_all=True, verbose=False, **kw)
    if loras:
        ads = [llama_cpp.llama_adapter_lora_init(llm.model, p.encode()) for p, _ in loras]
        assert all(ads), f"llama.cpp refused an adapter of {loras}"
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(ads))(*ads)
        scales = (llama_cpp.ctypes.c_float * len(ads))(*(s for _, s in loras))
        assert llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, arr, len(ads), scales) == 0
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        ids, steps = [], []
        for _ in range(n_steps):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
            lp = logits - logits.max()
            lp -= np.log(np.exp(lp).sum())
            top = np.argsort(-lp, kind="stable")[:5]
            steps.append({"top_ids": [int(t) for t in top], "top_logprobs": [round(float(lp[t]), 5) for t in top]})
            ids.append(int(top[0]))
            if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), int(top[0])):  # any end token
                break
            llm.eval([int(top[0])])
        out.append({"prompt_ids": prompt, "greedy_ids": ids, "steps": steps})
    return out


def embedder(path, pooling):
    return llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=POOL[pooling], n_ctx=512, n_batch=512,
                           n_ubatch=512, n_seq_max=16, verbose=False)


def pooled(llm, seqs):
    """Pooled outputs of token-id sequences decoded in one batch (llama-cpp-python's embed, on ids)."""
    llm._batch.reset()
    for i, ids in enumerate(seqs):
        llm._batch.add_sequence(ids, i, False)
    llm._ctx.kv_cache_clear()
    llm._ctx.decode(llm._batch)
    width = llama_cpp.llama_model_n_cls_out(llm.model) if llm.pooling_type() == POOL["rank"] else llm.n_embd()
    out = [[round(float(x), 6) for x in llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, i)[:width]]
           for i in range(len(seqs))]
    llm._batch.reset()
    return out


def pair(llm, query: str, doc: str) -> list[int]:
    """llama-server's format_prompt_rerank: the file's rerank template (Qwen3-Reranker's) tokenized with
    special-token text parsed, else query and document joined by the vocabulary's flags."""
    v = llama_cpp.llama_model_get_vocab(llm.model)
    template = llama_cpp.llama_model_chat_template(llm.model, b"rerank")
    if template is not None:
        prompt = template.decode().replace("{query}", query).replace("{document}", doc)
        return llm.tokenize(prompt.encode(), add_bos=False, special=True)
    eos = llama_cpp.llama_vocab_eos(v)
    eos = eos if eos >= 0 else llama_cpp.llama_vocab_sep(v)
    tok = lambda t: llm.tokenize(t.encode(), add_bos=False, special=False)  # noqa: E731
    add_eos = [eos] if llama_cpp.llama_vocab_get_add_eos(v) else []
    return ([llama_cpp.llama_vocab_bos(v)] if llama_cpp.llama_vocab_get_add_bos(v) else []) + tok(query) + add_eos \
        + ([llama_cpp.llama_vocab_sep(v)] if llama_cpp.llama_vocab_get_add_sep(v) else []) + tok(doc) + add_eos


if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    print(json.dumps({j["name"]: run(j["path"], j["prompts"], j["n_steps"], **j.get("kw", {})) for j in jobs}))
