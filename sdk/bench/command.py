"""`hearthlm bench`: its flags (beside the session options) and which measurement they pick.
Each measurement prints a table, or its rows as JSON with --json."""
from __future__ import annotations

import argparse
import json

import anyio

from hearthlm.bench import session_options
from hearthlm.bench.yardstick import ENV_PYTHON, Report, header_lines
from hearthlm.model_zoo.resolve import resolve_model

KV_LIST_HELP = "bench takes a comma list (e.g. f16,q8_0) and measures each in turn"
# the measurements' own sizes where no flag is given
BENCH_DEFAULTS = {"max_batch_tokens": "512, or --prompt-tokens where larger",
                  "max_seqs": "64, or the largest --concurrency level",
                  "kv_cache_tokens": "4 x n_ctx, or all of the --concurrency streams' tokens"}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=8, metavar="N",
                   help="prompt tokens before the decode measurement (decode after a long prompt: e.g. 1500)")
    p.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
    p.add_argument("--compare-llama-cpp", action="store_true",
                   help="the same work through llama-cpp-python, in rounds taken in turn with hearthlm's")
    p.add_argument("--llama-cpp-python", default=None, metavar="PATH",
                   help="the interpreter whose llama-cpp-python runs llama.cpp's side, in a child process "
                        f"(default ${ENV_PYTHON}, else this one if it imports llama_cpp)")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated levels, e.g. 1,4,16: aggregate tokens/s, p50/p99 time to first "
                        "token and inter-token latency with that many concurrent generations")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of the single-stream and --concurrency measurements, each engine in turn (medians)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--competing-load", type=int, default=0, metavar="N",
                   help="measure twice: quiet, then beside N CPU-bound processes (as other work in an app), "
                        "and report the fraction of the quiet rate each engine kept")
    p.add_argument("--competing-nice", type=int, default=0, metavar="K", help="the competitors' nice level")
    p.add_argument("--profile", action="store_true",
                   help="time per op kind, kernels vs Python, per decode step at --concurrency levels "
                        "(default 1,4,16,64)")
    p.add_argument("--sampled", action="store_true",
                   help="with --profile: the requests sample with SamplingParams' defaults (seeded) rather than "
                        "decode greedily")
    p.add_argument("--startup", action="store_true",
                   help="fresh processes that open the model and generate 1 token: start to first token and "
                        "peak RSS (paired with llama-cpp-python when importable); --repeat runs each")
    p.add_argument("--embed", action="store_true",
                   help="embedding texts/s at batch 1 and 32 (an encoder, or a decoder's embeddings)")
    p.add_argument("--first-run", action="store_true",
                   help="with --startup: also one start with empty kernel and weight caches (as after install)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft", "mtp"],
                   help="decode tok/s with and without speculation, on a code rewrite and on free text "
                        "(draft: with --draft-model, which may be a Gemma 4 assistant; mtp: the model's own MTP block)")
    p.add_argument("--image", action="store_true",
                   help="a vision tower: one image's encode time (first run apart) and \"describe this image\" to "
                        "its first token; the tower is --mmproj, else a random Gemma 3 SigLIP at --image-size paired "
                        "with --model (default gemma-3-270m); --threads default 2; --profile adds time per op kind")
    p.add_argument("--image-size", type=int, default=None, metavar="N",
                   help="with --image: the image's side (default the tower's: gemma3 896, a multiple of 56; qwen35 768)")
    p.add_argument("--tower", default="gemma3", choices=["gemma3", "qwen35"],
                   help="with --image and no --mmproj: gemma3 (SigLIP-400M, paired with --model) or qwen35 "
                        "(Qwen3.5-0.8B's tower and a random text model at its shapes)")
    p.add_argument("--streams", type=int, default=0, metavar="N",
                   help="with --image: N decoding streams' tokens/s alone, then beside a client sending new images "
                        "back to back; the ratio and the worst gap between a stream's consecutive tokens "
                        "(--decode-tokens each)")
    p.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="decode with N random LoRA adapters (stream i uses adapter i mod N) against the base alone, "
                        "aggregate tokens/s at the --concurrency levels (default 1,16), and each adapter's memory")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="the random adapters' rank")
    p.add_argument("--lora-type", default="f16", choices=["f16", "f32"],
                   help="the random adapters' type (convert_lora_to_gguf.py's --outtype; hearthlm keeps F16 at 2 bytes)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="aggregate tokens/s constrained by this JSON schema vs unconstrained, same prompts, at the "
                        "--concurrency levels (default 1,16); pick a schema whose outputs outrun --decode-tokens")


def _print_pairs(header: str, rows: list[dict], fmt: str) -> None:
    print(header)
    for r in rows:
        print("  ".join(f"{k}={v:{fmt}}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def _print_table(header: str, rows: list[dict], cols: list[str], width: int, fmt: str) -> None:
    print(header)
    print("  ".join(f"{c:>{width}}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>{width}{fmt}}" if isinstance(r.get(c), float) else f"{str(r.get(c, '')):>{width}}"
                        for c in cols))


def _path(a: argparse.Namespace) -> str:
    return str(resolve_model(a.model, filename=session_options(a).filename))


def _emit(a: argparse.Namespace, report: Report, rows, show) -> None:
    """--json: {"host", "load_start", "load_end", "llama_cpp" (the build, or null), "rows"}; else
    the host and build lines, then show()'s table."""
    facts = report.end()
    if a.json:
        print(json.dumps(dict(facts, rows=rows), indent=2))
        return
    for line in header_lines(facts):
        print(line)
    show()


def _embed(a: argparse.Namespace) -> None:
    from hearthlm.bench.embed import bench_embed
    report = Report()
    rows = bench_embed(a, _path(a), report)
    _emit(a, report, rows, lambda: _print_pairs(
        f"model: {a.model}  embeddings: texts of 16-128 tokens, texts/s (median of {a.repeat} rounds)", rows, ".2f"))


def _image(a: argparse.Namespace) -> None:
    if a.streams:
        from hearthlm.bench.vision_streams import bench_streams, print_streams
        facts = bench_streams(a)
        print(json.dumps(facts, indent=2)) if a.json else print_streams(facts)
        return
    from hearthlm.bench.vision import bench_image, print_image
    rows, facts = bench_image(a)
    if a.json:
        print(json.dumps(dict(rows=rows, **facts), indent=2))
    else:
        print_image(rows, facts)


def _profile(a: argparse.Namespace) -> None:
    from hearthlm.bench.profile import print_profile, run_profile
    report = Report()
    rows = run_profile(a)
    _emit(a, report, rows, lambda: print_profile(rows, a.model))


def _startup(a: argparse.Namespace) -> None:
    from hearthlm.bench.startup import bench_startup, first_run, print_rows
    from hearthlm.bench.yardstick import LlamaCppSide, interpreter
    path, n_ctx = _path(a), session_options(a).n_ctx
    report, py = Report(), interpreter(a)
    if py:
        with LlamaCppSide(py) as side:  # the build's facts (each timed start is a fresh process of its own)
            report.build = side.build
    rows = bench_startup(path, repeat=a.repeat, n_ctx=n_ctx, python=py)
    if a.first_run:
        rows.append(dict(engine="first run", **first_run(path, n_ctx)))
    _emit(a, report, rows, lambda: print_rows(
        rows, f"model: {a.model}  startup: medians of {a.repeat} fresh processes, 1 token each"))


def _speculative(a: argparse.Namespace) -> None:
    from hearthlm.bench.speculative import run as run_spec
    report = Report()
    rows = run_spec(a)
    _emit(a, report, rows, lambda: _print_pairs(
        f"model: {a.model}  speculative: {a.speculative}  {a.decode_tokens} tokens", rows, ".3f"))


def _json_schema(a: argparse.Namespace) -> None:
    from hearthlm.bench.speed import bench_json_schema
    report = Report()
    rows = anyio.run(bench_json_schema, a)
    _emit(a, report, rows, lambda: _print_pairs(
        f"model: {a.model}  schema: {a.json_schema}  max_tokens: {a.decode_tokens}", rows, ".3f"))


def _lora(a: argparse.Namespace) -> None:
    from hearthlm.bench.lora import bench_lora
    rows, facts = anyio.run(bench_lora, a)
    if a.json:
        print(json.dumps(dict(rows=rows, **facts), indent=2))
        return
    _print_pairs(f"model: {a.model}  LoRA: {a.lora_adapters} random rank-{a.lora_rank} {a.lora_type} adapters  decode: "
                 f"{a.decode_tokens} tokens per request (medians of {a.repeat} rounds)", rows, ".3f")
    _print_pairs("memory:", [facts], ".1f")


def _concurrency(a: argparse.Namespace) -> None:
    from hearthlm.bench.speed import concurrency_rows, with_load
    report = Report()
    rows = with_load(a, lambda: concurrency_rows(a, report)) if a.competing_load else concurrency_rows(a, report)
    _emit(a, report, rows, lambda: _print_table(f"model: {a.model}  decode: {a.decode_tokens} tokens per request  "
                                                f"(medians of {a.repeat} rounds, engines in turn)", rows,
                                                list(dict.fromkeys(c for r in rows for c in r)), 15, ".3f"))


def _single(a: argparse.Namespace) -> None:
    from hearthlm.bench import kv_types
    from hearthlm.bench.speed import single_rows, with_load
    if a.threads:
        import numba
        numba.set_num_threads(a.threads)
    report = Report()
    rows = with_load(a, lambda: single_rows(a, report)) if a.competing_load else single_rows(a, report)
    cols = ["engine", "backend", "load_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "mb_per_token",
            "roofline"] + (["kv_bytes_per_token"] if len(kv_types(a)) > 1 else [])
    _emit(a, report, rows, lambda: _print_table(
        f"model: {a.model}  prompt: {a.prompt_tokens} tokens  decode: {a.decode_tokens} tokens", rows, cols, 13, ".2f"))


def run_bench(a: argparse.Namespace) -> None:
    """The first of --image, --embed, --profile, --startup, --speculative, --json-schema,
    --lora-adapters, --concurrency given; else single-stream prefill and decode."""
    for flag, measure in (("image", _image), ("embed", _embed), ("profile", _profile), ("startup", _startup),
                          ("speculative", _speculative), ("json_schema", _json_schema), ("lora_adapters", _lora),
                          ("concurrency", _concurrency)):
        if getattr(a, flag):
            return measure(a)
    _single(a)
