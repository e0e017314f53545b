"""Command line: `hearthlm generate "prompt"` streams text to stdout; `hearthlm chat` is an
interactive chat in the terminal; `hearthlm bench`
measures a model; `hearthlm prepare` fills the kernel and weight caches with progress;
`hearthlm graph` prints a step's compute graph; `hearthlm serve` runs the OpenAI-compatible
server; `hearthlm pull` and `hearthlm models` fetch and list model files. `python -m hearthlm`
is the same."""
from __future__ import annotations

import argparse
import sys

import anyio

from hearthlm.backends import BACKENDS
from hearthlm.model_zoo.resolve import DEFAULT_MODEL
from hearthlm.core.errors import HearthError
from hearthlm.session import Session


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a .gguf path, a Hub repo id or a model-zoo name (default {DEFAULT_MODEL})")
    p.add_argument("--filename", default=None, help="file pattern inside a Hub repo, e.g. '*Q4_K_M.gguf'")
    p.add_argument("--backend", default="cpu", choices=list(BACKENDS))
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--kv-cache-type", default="f16", metavar="TYPE",
                   help="K/V cache element type: f16 (default), q8_0 (about half the memory) or q4_0; "
                        "bench takes a comma list (e.g. f16,q8_0) and measures each in turn")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a smaller model of the same vocabulary that drafts tokens for speculative decoding")
    p.add_argument("--draft-p-min", type=float, default=0.75, metavar="P",
                   help="drafting stops at the draft model's first token below this probability (default 0.75)")


def draft_args(a: argparse.Namespace) -> dict:
    """Session.open's draft-model options from the command line."""
    return dict(draft_model=a.draft_model, draft_p_min=a.draft_p_min) if getattr(a, "draft_model", None) else {}


async def _generate(a: argparse.Namespace) -> None:
    async with Session.open(a.model, backend=a.backend, n_ctx=a.n_ctx, filename=a.filename,
                            kv_cache_type=a.kv_cache_type, **draft_args(a)) as s:
        kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
        stream = s.stream(messages=[{"role": "user", "content": a.prompt}], **kw) if a.chat else s.stream(a.prompt, **kw)
        async for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hearthlm", description="Run GGUF language models locally.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    ch = sub.add_parser("chat", help="chat in the terminal: one line a turn, answers streamed (/help inside)")
    _add_model_args(ch)
    from hearthlm.chat_cmd import add_chat_args, run_chat
    add_chat_args(ch)
    b = sub.add_parser("bench", help="measure prefill and decode speed, load time and memory")
    _add_model_args(b)
    from hearthlm.bench import add_bench_args, run_bench
    add_bench_args(b)
    pr = sub.add_parser("prepare", help="compile the kernels and pack the weights a model needs, with progress "
                                        "(what the first start after an install does otherwise)")
    _add_model_args(pr)
    gr = sub.add_parser("graph", help="print a step's compute graph before and after fusion")
    _add_model_args(gr)
    from hearthlm.graph_cmd import add_graph_args, run_graph
    add_graph_args(gr)
    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub (resumes an interrupted one)")
    from hearthlm.hub_cmd import add_pull_args, run_models, run_pull
    add_pull_args(pl)
    sub.add_parser("models", help="list the model-zoo names and the model files on disk")
    sv = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API (needs hearthlm[server])")
    from hearthlm.serve.server import add_serve_args, run_serve
    add_serve_args(sv)
    pp = sub.add_parser("perplexity", help="a text's perplexity, as llama-perplexity computes it")
    _add_model_args(pp)
    from hearthlm.perplexity import add_perplexity_args, run_perplexity
    add_perplexity_args(pp)
    a = parser.parse_args(argv)
    try:
        if a.command == "generate":
            anyio.run(_generate, a)
        elif a.command == "chat":
            return run_chat(a)
        elif a.command == "pull":
            run_pull(a)
        elif a.command == "models":
            run_models(a)
        elif a.command == "serve":
            run_serve(a)
        elif a.command == "perplexity":
            run_perplexity(a)
        elif a.command == "graph":
            run_graph(a)
        elif a.command == "prepare":
            from hearthlm.startup_bench import prepare
            prepare(a.model, a.filename)
        else:
            run_bench(a)
    except HearthError as e:
        print(f"hearthlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
