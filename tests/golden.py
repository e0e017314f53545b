"""Real models against llama.cpp's outputs, recorded with llama-cpp-python 0.3.36 (CPU, 2 threads,
n_ctx 1024) twice: on the quantized files as they are (tests/data/<model>.visible.json) and on
copies with the weights dequantized to F32 (tests/data/golden_dequantized.json,
tests/parity/record_dequantized.py): per case the prompt's ids, 32 greedy steps and each step's
top 5 (ids, log-probs). Against each record: vLLM's criterion (walk both greedy sequences; at
the first difference each side's token must be in the other side's top 5 at that step; then
stop) and, at every step before that difference, the log-probs within a tolerance.

The tolerances, from the largest deviations measured (nats, the six cases of each model;
SmolLM2 / Gemma 3 / Qwen2.5, cpu on AVX-512):
- the quantized record: llama.cpp rounds the activations to 8 bits for its quantized matmuls,
  which moves its own log-probs from its F32 run's by up to 0.22 (top token) and 0.96 (top 5);
  so only the top token is held, at every step, within 0.25 (reference 0.215 / 0.180 / 0.074,
  cpu 0.176 / 0.176 / 0.098);
- the F32 record: the numpy reference computes in float32 as llama.cpp then does: top 5 within
  0.05 (measured 0.016 / 0.032 / 0.021; a 2% error in the attention scale moves them by up to
  0.6). The cpu and cuda backends round activations to 8 bits as llama.cpp does (their own
  rounding, not its): top token within 0.25, top 5 within 1.0 (cpu 0.182 / 0.146 / 0.068 and
  0.72 / 0.47 / 0.24).
The cpu figures move with the last bits of any kernel (an 8-bit activation rounding flips): Gemma 3's
largest quantized-record deviation came out 0.124, 0.176, 0.178, 0.185 and 0.289 in five builds that
differ only in the order of some kernels' float operations (which kernels may reassociate; a GLU
compiled or cached: ops._JIT_ORDERED), SmolLM2's 0.176 to 0.247.
"""
import contextlib

import anyio

from hearthlm import Session

# the quantized record's top token, every step (the F32 parity tests set it to 0.05)
TOP1_LOGPROB_TOL = 0.25
# the F32 record: (top token, top 5) per backend; backends that round activations to int8 by default
F32_TOL = {"reference": (0.05, 0.05)}
F32_TOL_INT8 = (0.25, 1.0)


def compare(case: dict, token_ids: list[int], top: list[list[tuple[int, float]]], finish: str,
            top1_tol: float | None = None, tie_tol: float = 0.0, topk_tol: float | None = None,
            every_step: bool = True) -> str | None:
    """None when the case passes, else what went wrong. llama.cpp's list ends with the EOS
    token when one came; ours stops before it (finish_reason "stop"), unless it ran with
    ignore_eos (check_golden does: an EOS is then a step like any other, and ours may run past
    the record's end). tie_tol: at the first difference it is also enough that llama.cpp put our
    token within tie_tol nats of its own (a near-tie in its run, which a coarse KV cache's
    rounding may turn either way). Log-probs: llama.cpp's top token within top1_tol at the first
    step and at every step while the tokens agree (at the first step only, every_step False); with
    topk_tol, each of its top 5 that is in ours within topk_tol too. Not at the first difference:
    a flip is where the two sides' rounding differs most (SmolLM2's cpu: 0.41 there, 0.15 before).
    top1_tol None: TOP1_LOGPROB_TOL as it is at the call (the F32 parity tests set it to 0.05); a list:
    one per step (check_golden's F32 record: own_drift)."""
    top1_tol = TOP1_LOGPROB_TOL if top1_tol is None else top1_tol
    want = case["greedy_ids"]
    n = min(len(token_ids), len(want))  # the steps on which both greedy sequences agree
    for i, (a, b) in enumerate(zip(token_ids, want)):
        if a != b:
            ours = [t for t, _ in top[i]]
            step = case["steps"][i]
            theirs = step["top_ids"]
            if a in theirs and (b in ours or step["top_logprobs"][theirs.index(a)] >= step["top_logprobs"][0] - tie_tol):
                n = i
                break
            return f"step {i}: ours {a} (top {ours}) vs llama.cpp {b} (top {theirs})"
    else:
        eos_end = finish == "stop" and len(want) == len(token_ids) + 1
        if len(token_ids) < len(want) and not eos_end:
            return f"length {len(token_ids)} vs llama.cpp {len(want)}"
    for i in range(max(n, 1) if every_step else 1):  # the first step whatever follows
        step, ours = case["steps"][i], dict(top[i])
        for k, (t, lp) in enumerate(zip(step["top_ids"], step["top_logprobs"])):
            tol = (top1_tol[i] if isinstance(top1_tol, list) else top1_tol) if k == 0 else topk_tol
            if tol is None:
                break
            if (k == 0 and t not in ours) or (t in ours and abs(ours[t] - lp) > tol):
                return f"step {i}: llama.cpp's top-{k + 1} token {t} ({lp:.3f}) vs ours {ours} (tolerance {tol})"
    return None



def avx2_host() -> bool:
    """Whether the CPU kernels compile without AVX-512 (the host's features, or numba's
    NUMBA_CPU_FEATURES): their quantized record is then llama.cpp's AVX2 one."""
    from hearthlm.backends.cpu.halfs import TARGET_FEATURES
    return "+avx512f" not in TARGET_FEATURES


def for_host(cases: list[dict], backend: str) -> list[dict]:
    """The quantized record's cases as llama.cpp computes them on a CPU like the one the kernels
    compile for: on the cpu backend without AVX-512, tests/data/golden_avx2.json's (llama.cpp's
    AVX2 build moves a near-tie's top token by 0.2 nat from its AVX-512 record, as our AVX2
    kernels move ours: tests/parity/record_avx2.py), matched by prompt ids; else as they are."""
    if backend != "cpu" or not avx2_host():
        return cases
    from conftest import load_json
    by_prompt = {tuple(c["prompt_ids"]): c for m in load_json("golden_avx2.json")["models"].values()
                 for c in m["cases"]}
    return [{**c, **by_prompt[tuple(c["prompt_ids"])]} for c in cases]


def own_drift(quantized: dict, f32: dict) -> list[float]:
    """Per step of the F32 record: how far llama.cpp's own quantized run put the F32 record's top token
    from it (while the two runs' tokens agree; 0 after), the slack an int8 backend gets on top of the F32
    tolerance there. Its int8 activations move log-probs as ours do: SmolLM2 case 0 step 5, 0.438 nat in
    llama.cpp's own Q4_1 run, where ours read 0.18-0.33 as kernels' float orders changed."""
    out = []
    for i, (a, b) in enumerate(zip(quantized["steps"], f32["steps"])):
        if quantized["greedy_ids"][:i] != f32["greedy_ids"][:i]:
            break
        lp = dict(zip(a["top_ids"], a["top_logprobs"])).get(b["top_ids"][0])
        out.append(0.0 if lp is None else abs(lp - b["top_logprobs"][0]))
    return out + [0.0] * (len(f32["steps"]) - len(out))


def compare_top5(case: dict, c, tol: float, top1_tol: float | None = None) -> str | None:
    """compare(), then each of llama.cpp's top 5 that is in ours within `tol` nats at every step while the
    greedy tokens agree (the vision parity tests' criterion; `c` a Completion with top_logprobs)."""
    why = compare(case, c.token_ids, c.top_logprobs, c.finish_reason, top1_tol=top1_tol)
    for step, (ours, want) in enumerate(zip(c.top_logprobs, case["steps"])):
        mine = dict(ours)
        bad = [(t, round(mine[t], 5), lp) for t, lp in zip(want["top_ids"], want["top_logprobs"])
               if t in mine and abs(mine[t] - lp) > tol]
        if bad and why is None:
            why = f"step {step}: (token, ours, llama.cpp) {bad}"
        if step >= len(c.token_ids) or c.token_ids[step] != case["greedy_ids"][step]:
            break
    return why

@contextlib.asynccontextmanager
async def _untuned_threads():
    """Every step on all of numba's threads, the tuner's timing out of the runs. The outputs do not
    depend on the count (bit for bit on 1 and 2 threads: tests/test_kernel_cache.py, and Gemma 3's
    goldens): the 0.29 once put down to one thread here (Gemma 3, case 0 step 6; its q4_0 case 4
    parting at step 2) came from freshly compiled kernels, whose GLU differed from the cached one's
    in its last bits (ops._JIT_ORDERED)."""
    import numba

    from hearthlm.backends.cpu.backend import CPUBackend
    tuned = CPUBackend.thread_counts
    # one count to choose from, set on every step: a thread an earlier session left at 1 is reset
    CPUBackend.thread_counts = lambda self: (numba.config.NUMBA_NUM_THREADS,)
    try:
        yield
    finally:
        CPUBackend.thread_counts = tuned


async def check_golden(path, backend: str, cases: list[dict], top1_tol: float | None = None,
                       tie_tol: float = 0.0, dequantized: list[dict] | None = None,
                       every_step: bool = True, **open_kw) -> None:
    """The cases run concurrently: one batch a step (a greedy sequence does not depend on its
    neighbours: tests/test_engine.py), which the numpy reference backend computes in about the
    time of one sequence. `dequantized`: the same cases' F32 record, compared too (F32_TOL).
    `open_kw`: more Session.open options (kv_cache_type, say)."""
    failures = []
    if "kv_cache_type" not in open_kw:  # the AVX2 record is the default (f16) cache's
        cases = for_host(cases, backend)
    f32_top1, f32_topk = F32_TOL.get(backend, F32_TOL_INT8)
    async with _untuned_threads(), Session.open(str(path), backend=backend, n_ctx=1024, **open_kw) as s:
        async def one(i: int, case: dict) -> None:
            # past an EOS too: where ours and llama.cpp's differ on ending (a near-tie with EOS),
            # the criterion needs our top 5 at that step, which a stopped request does not give
            n = max(len(case["greedy_ids"]), len(dequantized[i]["greedy_ids"]) if dequantized else 0)
            c = await s.generate(case["prompt_ids"], max_tokens=n, temperature=0, top_logprobs=5, ignore_eos=True)
            why = compare(case, c.token_ids, c.top_logprobs, c.finish_reason, top1_tol, tie_tol, every_step=every_step)
            if why:
                failures.append(f"case {i} ({case['prompt'][:30]!r}): {why}")
            if dequantized:
                assert dequantized[i]["prompt_ids"] == case["prompt_ids"]
                why = compare(dequantized[i], c.token_ids, c.top_logprobs, c.finish_reason,
                              [f32_top1 + d for d in own_drift(case, dequantized[i])], topk_tol=f32_topk)
                if why:
                    failures.append(f"case {i} ({case['prompt'][:30]!r}) against the F32 record: {why}")
        async with anyio.create_task_group() as tg:
            for i, case in enumerate(cases):
                tg.start_soon(one, i, case)
    assert not failures, "\n".join(sorted(failures))
