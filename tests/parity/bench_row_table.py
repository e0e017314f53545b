"""First load and peak RSS of a model whose per_layer_token_embd is a RowTable (left in the file) or, with
`packed`, packed like any matrix (as before): one fresh process per run, the weight cache in CACHE_DIR.
    python tests/parity/bench_row_table.py MODEL.gguf rows|packed CACHE_DIR"""
import asyncio
import json
import os
import resource
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


async def main(path: str, mode: str, cache: str) -> None:
    if mode == "packed":  # the table read as a plain weight: packed at load (and cached)
        import hearthlm.model_zoo.tensors as tensors
        from hearthlm.core.weights import QWeight
        tensors.RowTable = QWeight
    from hearthlm import Session
    t0 = time.perf_counter()
    async with Session.open(path, backend="cpu", n_ctx=256, weight_cache=cache) as s:
        t1 = time.perf_counter()
        c = await s.generate([2, 1000, 2000, 3000], max_tokens=4, temperature=0)
        t2 = time.perf_counter()
        d = await s.generate([2, 7000, 8000], max_tokens=32, temperature=0, ignore_eos=True)
        decode = len(d.token_ids) / (time.perf_counter() - t2)  # 32 steps after a 3-token prompt
        rss = _rss_mb()
    print(json.dumps({"mode": mode, "open_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2), "decode_tok_s": round(decode, 2),
                      "rss_mb": round(rss), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "tokens": c.token_ids, "cache_files_mb": round(sum(
                          os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs) / 2**20)}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
