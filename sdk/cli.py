"""Command line: `hearthlm generate "prompt"` streams text to stdout; `hearthlm chat` is an
interactive chat in the terminal; `hearthlm bench` measures a model (hearthlm.bench);
`hearthlm prepare` fills the kernel and weight caches with progress; `hearthlm graph` prints a
step's compute graph; `hearthlm serve` runs the OpenAI-compatible server; `hearthlm perplexity`
scores a text as llama-perplexity does; `hearthlm pull` and `hearthlm models` fetch and list
model files. `python -m hearthlm` is the same. The session options (hearthlm.SessionOptions)
are flags of every command that opens a model (`hearthlm serve --help` lists them)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio

from hearthlm import options
from hearthlm.core.errors import HearthError
from hearthlm.model_zoo.chat_template import MEDIA_MARKER
from hearthlm.model_zoo.resolve import DEFAULT_MODEL
from hearthlm.session import Session

# the options `prepare` and `graph` took before every command had them all (they read few of them)
FEW = ("filename", "backend", "n_ctx", "kv_cache_type", "draft_model", "draft_p_min")


def _add_model_args(p: argparse.ArgumentParser, **kw) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a .gguf path, a Hub repo id or a model-zoo name (default {DEFAULT_MODEL})")
    options.add_arguments(p, **kw)


async def _generate(a: argparse.Namespace) -> None:
    async with Session.open(a.model, options=options.from_args(a)) as s:
        kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed,
                  adapters={n: 1.0 for n in s.adapters} or None)  # --lora's, applied as llama-cli does
        images = [Path(p) for p in a.image or ()]
        if a.chat:
            parts = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": a.prompt}]
            stream = s.stream(messages=[{"role": "user", "content": parts if images else a.prompt}], **kw)
        else:  # as llama-mtmd-cli: images without a marker in the prompt go first
            prompt = a.prompt if not images or MEDIA_MARKER in a.prompt else MEDIA_MARKER * len(images) + a.prompt
            stream = s.stream(prompt, images=images or None, **kw)
        async for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")


def _prepare(a: argparse.Namespace) -> None:
    from hearthlm.bench.startup import prepare
    prepare(a.model, options.from_args(a).filename)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each sub-parser's `run` default is its command."""
    from hearthlm.bench.command import BENCH_DEFAULTS, KV_LIST_HELP, add_bench_args, run_bench
    from hearthlm.chat_cmd import add_chat_args, run_chat
    from hearthlm.graph_cmd import add_graph_args, run_graph
    from hearthlm.hub_cmd import add_pull_args, run_models, run_pull
    from hearthlm.perplexity import add_perplexity_args, run_perplexity
    from hearthlm.serve.server import add_serve_args, run_serve
    parser = argparse.ArgumentParser(prog="hearthlm", description="Run GGUF language models locally.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--image", action="append", metavar="FILE",
                   help=f"an image for the model to see (repeatable; needs its mmproj): in the prompt at each "
                        f"{MEDIA_MARKER}, else before it")
    _add_model_args(g)
    g.set_defaults(run=lambda a: anyio.run(_generate, a))
    ch = sub.add_parser("chat", help="chat in the terminal: one line a turn, answers streamed (/help inside)")
    add_chat_args(ch)
    _add_model_args(ch)
    ch.set_defaults(run=run_chat)
    b = sub.add_parser("bench", help="measure prefill and decode speed, load time and memory")
    add_bench_args(b)
    _add_model_args(b, help={"kv_cache_type": KV_LIST_HELP}, defaults=BENCH_DEFAULTS)
    b.set_defaults(run=run_bench)
    pr = sub.add_parser("prepare", help="compile the kernels and pack the weights a model needs, with progress "
                                        "(what the first start after an install does otherwise)")
    _add_model_args(pr, only=FEW)
    pr.set_defaults(run=_prepare)
    gr = sub.add_parser("graph", help="print a step's compute graph before and after fusion")
    add_graph_args(gr)
    _add_model_args(gr, only=FEW)
    gr.set_defaults(run=run_graph)
    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub (resumes an interrupted one)")
    add_pull_args(pl)
    pl.set_defaults(run=run_pull)
    sub.add_parser("models", help="list the model-zoo names and the model files on disk").set_defaults(run=run_models)
    sv = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API (needs hearthlm[server])")
    add_serve_args(sv)
    sv.set_defaults(run=run_serve)
    pp = sub.add_parser("perplexity", help="a text's perplexity, as llama-perplexity computes it")
    add_perplexity_args(pp)
    _add_model_args(pp, defaults={"n_ctx": "--ctx"})
    pp.set_defaults(run=run_perplexity)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        code = a.run(a)
    except HearthError as e:
        print(f"hearthlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code if isinstance(code, int) else 0
