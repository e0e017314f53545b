"""llama.cpp's side of `hearthlm bench --compare-llama-cpp`, run as a script by the interpreter
--llama-cpp-python names (it imports only llama_cpp, numpy and the standard library; never hearthlm):

    python llama_cpp_side.py            one JSON command a line on stdin, one JSON answer a line
    python llama_cpp_side.py --startup MODEL N_CTX PROMPT   one fresh start (bench --startup)

The first answer, before any command, is the build: {"llama_cpp_python": version, "system_info",
"python"}. Commands ({"op": ...}):
  load {path, n_ctx, threads, n_batch, embedding?, n_seq_max?} -> {load_s}
  eval {ids} -> {s}                                  (a warm-up: the ids prefilled from an empty context)
  round {prompt, decode_prompt, decode_tokens} -> {prefill_tok_s, ttft_s, decode_tok_s, tokens, peak_rss_mb}
  serial {prompts, decode_tokens} -> {wall_s, ttft_s: [..], itl_s: [..], counts: [..]}
      (requests arriving together, served one at a time as llama-cpp-python does)
  embed {inputs, batch, warm} -> {texts_s}
An exception answers {"error": "..."}; the script ends when stdin closes."""
from __future__ import annotations

import json
import os
import sys
import time


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024


def build() -> dict:
    import llama_cpp
    info = llama_cpp.llama_print_system_info()
    return dict(llama_cpp_python=llama_cpp.__version__, python=sys.executable,
                system_info=(info.decode() if isinstance(info, bytes) else str(info)).strip(" |"))


class Side:
    def __init__(self) -> None:
        self.llm = None

    def load(self, path: str, n_ctx: int, threads: int, n_batch: int = 512, embedding: bool = False,
             n_seq_max: int = 1) -> dict:
        import llama_cpp
        t = time.perf_counter()
        kw = dict(embedding=True, n_ubatch=n_batch, n_seq_max=n_seq_max) if embedding else {}

        def open_(**more):
            return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=n_batch, verbose=False, **kw, **more)
        self.llm = open_()
        if embedding and llama_cpp.llama_pooling_type(self.llm._ctx.ctx) == llama_cpp.LLAMA_POOLING_TYPE_NONE:
            # a decoder's file names no pooling: mean, as hearthlm pools it (no per-sequence embeddings else)
            self.llm.close()
            self.llm = open_(pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        return dict(load_s=time.perf_counter() - t)

    def eval(self, ids: list[int]) -> dict:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return dict(s=time.perf_counter() - t)

    def round(self, prompt: list[int], decode_prompt: list[int], decode_tokens: int) -> dict:
        llm = self.llm
        prefill_s = self.eval(prompt)["s"]
        llm.reset()
        t, first, n = time.perf_counter(), None, 0
        for _tok in llm.generate(decode_prompt, temp=0.0, top_k=1):
            if first is None:
                first = time.perf_counter() - t
            n += 1
            if n >= decode_tokens:
                break
        decode_s = time.perf_counter() - t - first
        return dict(prefill_tok_s=len(prompt) / prefill_s, ttft_s=first, tokens=n,
                    decode_tok_s=(n - 1) / decode_s if n > 1 else 0.0, peak_rss_mb=peak_rss_mb())

    def serial(self, prompts: list[list[int]], decode_tokens: int) -> dict:
        llm, ttft, itl, counts = self.llm, [], [], []
        t0 = time.perf_counter()
        for p in prompts:
            llm.reset()
            last, k = None, 0
            for _ in llm.generate(p, temp=0.0, top_k=1, reset=True):
                now = time.perf_counter()
                if k == 0:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last, k = now, k + 1
                if k >= decode_tokens:
                    break
            counts.append(k)
        return dict(wall_s=time.perf_counter() - t0, ttft_s=ttft, itl_s=itl, counts=counts)

    def embed(self, inputs: list[list[int]], batch: int, warm: bool) -> dict:
        import llama_cpp
        llm = self.llm

        def decode(seqs):
            llm._batch.reset()
            for i, ids in enumerate(seqs):
                llm._batch.add_sequence(ids, i, False)
            llm._ctx.kv_cache_clear()
            llm._ctx.decode(llm._batch)
            return [llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, i)[0] for i in range(len(seqs))]

        def embed(batch_ids):  # llama-cpp-python's embed(list), on ids: decodes of up to n_batch tokens
            out, group, n = [], [], 0
            for ids in batch_ids:
                if group and (n + len(ids) > llm.n_batch or len(group) >= 32):
                    out += decode(group)
                    group, n = [], 0
                group.append(ids)
                n += len(ids)
            return out + decode(group)

        def rate() -> float:
            t0 = time.perf_counter()
            for i in range(0, len(inputs), batch):
                embed(inputs[i:i + batch])
            return len(inputs) / (time.perf_counter() - t0)
        if warm:
            rate()
        return dict(texts_s=rate())


def startup(path: str, n_ctx: int, prompt: str) -> None:
    """One fresh start: import, open, one token; times as wall clock (comparable across processes)."""
    t0 = time.time()
    from llama_cpp import Llama
    t1 = time.time()
    llm = Llama(model_path=path, n_ctx=n_ctx, verbose=False)
    t2 = time.time()
    llm.create_completion(prompt, max_tokens=1, temperature=0)
    t3 = time.time()
    print(json.dumps(dict(t_token=t3, import_s=t1 - t0, open_s=t2 - t1, first_token_s=t3 - t2,
                          peak_rss_mb=peak_rss_mb())), flush=True)


def serve() -> None:
    out = os.fdopen(os.dup(1), "w")  # the answers' channel; anything llama.cpp prints goes to stderr
    os.dup2(2, 1)

    def say(d: dict) -> None:
        out.write(json.dumps(d) + "\n")
        out.flush()
    say(build())
    side = Side()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op not in ("load", "eval", "round", "serial", "embed") or (op != "load" and side.llm is None):
                raise ValueError(f"unknown command {op!r}" if op not in ("eval", "round", "serial", "embed")
                                 else f"{op!r} before load")
            say(getattr(side, op)(**cmd))
        except Exception as e:  # answered, not fatal: the parent names it
            say(dict(error=f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--startup"]:
        startup(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        serve()
