"""Real models against llama.cpp's outputs, recorded once with llama-cpp-python 0.3.36 (CPU,
2 threads, n_ctx 1024) into tests/data/<model>.visible.json: per case the prompt's ids,
32 greedy steps and each step's top 5 (ids, log-probs). The comparison is vLLM's criterion
against a reference: walk both greedy sequences; at the first difference each side's token
must be in the other side's top 5 at that step; then stop. The first step's top-1 log-prob
must also agree."""
import anyio

from hearthlm import Session

# llama.cpp quantizes activations to 8 bits inside its matmuls; our kernels keep them
# (near) exact, so first-step log-probs differ by up to ~0.16 nats on SmolLM2's cases
TOP1_LOGPROB_TOL = 0.2


def compare(case: dict, token_ids: list[int], top: list[list[tuple[int, float]]], finish: str,
            top1_tol: float = TOP1_LOGPROB_TOL, tie_tol: float = 0.0) -> str | None:
    """None when the case passes, else what went wrong. llama.cpp's list ends with the EOS
    token when one came; ours stops before it (finish_reason "stop"), unless it ran with
    ignore_eos (check_golden does: an EOS is then a step like any other). tie_tol: at the first
    difference it is also enough that llama.cpp put our token within tie_tol nats of its own
    (a near-tie in its run, which a coarse KV cache's rounding may turn either way)."""
    want = case["greedy_ids"]
    for i, (a, b) in enumerate(zip(token_ids, want)):
        if a != b:
            ours = [t for t, _ in top[i]]
            step = case["steps"][i]
            theirs = step["top_ids"]
            if a in theirs and (b in ours or step["top_logprobs"][theirs.index(a)] >= step["top_logprobs"][0] - tie_tol):
                break
            return f"step {i}: ours {a} (top {ours}) vs llama.cpp {b} (top {theirs})"
    else:
        eos_end = finish == "stop" and len(want) == len(token_ids) + 1
        if len(token_ids) != len(want) and not eos_end:
            return f"length {len(token_ids)} vs llama.cpp {len(want)}"
    # llama.cpp's top token at the first step, looked up in our top 5
    ref_id, ref_lp = case["steps"][0]["top_ids"][0], case["steps"][0]["top_logprobs"][0]
    ours = dict(top[0])
    if ref_id not in ours or abs(ours[ref_id] - ref_lp) > top1_tol:
        return f"first step: llama.cpp's top token {ref_id} ({ref_lp:.3f}) vs ours {ours}"
    return None


async def check_golden(path, backend: str, cases: list[dict], top1_tol: float = TOP1_LOGPROB_TOL,
                       tie_tol: float = 0.0, allowed: int = 0, **open_kw) -> None:
    """The cases run concurrently: one batch a step (a greedy sequence does not depend on its
    neighbours: tests/test_engine.py), which the numpy reference backend computes in about the
    time of one sequence. `allowed`: cases that may fail (a coarse KV cache's chaotic paths).
    `open_kw`: more Session.open options (kv_cache_type, say)."""
    failures = []
    async with Session.open(str(path), backend=backend, n_ctx=1024, **open_kw) as s:
        async def one(i: int, case: dict) -> None:
            # past an EOS too: where ours and llama.cpp's differ on ending (a near-tie with EOS),
            # the criterion needs our top 5 at that step, which a stopped request does not give
            c = await s.generate(case["prompt_ids"], max_tokens=len(case["greedy_ids"]), temperature=0,
                                 top_logprobs=5, ignore_eos=True)
            why = compare(case, c.token_ids, c.top_logprobs, c.finish_reason, top1_tol, tie_tol)
            if why:
                failures.append(f"case {i} ({case['prompt'][:30]!r}): {why}")
        async with anyio.create_task_group() as tg:
            for i, case in enumerate(cases):
                tg.start_soon(one, i, case)
    assert len(failures) <= allowed, "\n".join(sorted(failures))
