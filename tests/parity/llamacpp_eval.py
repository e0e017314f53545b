"""Run by tests/parity/record.py under a Python with llama-cpp-python (never in CI): greedy
steps and top-5 log-probs of llama.cpp on the given GGUFs. argv: a JSON list of
{"name", "path", "prompts", "n_steps"}; prints the results as JSON."""
import json
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama


def run(path: str, prompts: list[list[int]], n_steps: int, **kw) -> list[dict]:
    llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=256, logits_all=True, verbose=False, **kw)
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


if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    print(json.dumps({j["name"]: run(j["path"], j["prompts"], j["n_steps"], **j.get("kw", {})) for j in jobs}))
