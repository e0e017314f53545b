"""`hearthlm bench --image`: a vision tower's cost at its real image size. Encode: one image
through runtime.vision.VisionEncoder on the cpu backend (BLAS single-threaded, as inside a running
engine), the first run apart (it builds the graph and packs the weights), then the median of
--repeat runs. Time to first token: Session.generate of "describe this image" with a new image
each round and max_tokens=1 (decoding, preprocessing, encoding, prefill and one sample). Without
--mmproj the tower is a random-weight Gemma 3 SigLIP (hearthlm.bench.vision_files) paired with the
text model, or with --tower qwen35 Qwen3.5-0.8B's tower and text model, both random (vision_qwen.py).
--compare-llama-cpp runs the same file and pixels through libmtmd (vision_llama_cpp.py, in the
interpreter --llama-cpp-python names, as every bench mode's llama.cpp side: hearthlm.bench.yardstick),
its rounds in turn with hearthlm's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import anyio
import numpy as np

from hearthlm.bench import session_options
from hearthlm.bench.yardstick import ENV_PYTHON, cpu_facts, interpreter, load_average
from hearthlm.core.errors import InvalidRequestError
from hearthlm.model_zoo.resolve import DEFAULT_MODEL, resolve_model

PAIRED_TEXT_MODEL = "gemma-3-270m"  # the text model --image opens when --model is left at the default
PROMPT = "<start_of_turn>user\n<__media__>describe this image<end_of_turn>\n<start_of_turn>model\n"
N_CTX = 1024


def host_line() -> str:
    """The CPU model, its cores for this process and the load average (a shared machine's noise)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return f"cpu: {model}, {len(os.sched_getaffinity(0))} cores  load average (1/5/15 min): {load}"


def _image(size: int, seed: int) -> np.ndarray:
    """(size, size, 3) uint8 noise: a new image per round, so no cache (encoder rows, KV prefix) serves it."""
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _files(a) -> tuple[str, str, str, int | None]:
    """(text model, mmproj, prompt, image side or None: the tower's own) for --tower / --model / --mmproj."""
    if getattr(a, "tower", "gemma3") == "qwen35" and not isinstance(getattr(a, "mmproj", None), (str, os.PathLike)):
        from hearthlm.bench import vision_qwen
        t = time.perf_counter()
        text, mmproj = vision_qwen.cached_qwen35_pair()
        if time.perf_counter() - t > 1:
            print(f"wrote {text} and {mmproj}", file=sys.stderr)
        return str(text), str(mmproj), vision_qwen.PROMPT, a.image_size or vision_qwen.QWEN35_VIT.image_size
    text = _text_model(a)
    return text, _mmproj(a, text), PROMPT, a.image_size


def _text_model(a) -> str:
    model = PAIRED_TEXT_MODEL if a.model == DEFAULT_MODEL else a.model
    return str(resolve_model(model, filename=session_options(a).filename))


def _mmproj(a, text_path: str) -> str:
    """--mmproj, else the random Gemma 3 tower at --image-size (896) for this text model's width."""
    given = getattr(a, "mmproj", None)
    if isinstance(given, (str, os.PathLike)):
        return str(given)
    from hearthlm.bench.vision_files import cached_gemma3_mmproj
    from hearthlm.model_zoo.gguf_file import GGUFFile
    with GGUFFile.open(text_path) as f:
        arch = f.metadata.get("general.architecture")
        n_embd = f.metadata.get(f"{arch}.embedding_length")
    if n_embd is None:
        raise InvalidRequestError(f"{text_path}: no {arch}.embedding_length to size the projection by")
    t = time.perf_counter()
    path = cached_gemma3_mmproj(n_embd_text=int(n_embd), image_size=a.image_size or 896)
    if time.perf_counter() - t > 1:
        print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    return str(path)


# ---- hearthlm's encoder ------------------------------------------------------------------

def _category(op: str, name: str) -> str:
    """A profile row for a kernel, by its node's name (vit.py and gemma3.py name them)."""
    base = name.split("[")[0]
    if op == "attn_full":
        return "attention (attn_full)"
    if op.startswith("mul_mat"):
        for key, cat in (("attn_q", "matmul q/k/v"), ("attn_k", "matmul q/k/v"), ("attn_v", "matmul q/k/v"),
                         ("attn_out", "matmul attn_out"), ("ffn_up", "matmul ffn_up"), ("ffn_down", "matmul ffn_down"),
                         ("inp_embd", "patch embedding"), ("mm_proj", "projection + soft_emb_norm"),
                         ("mm.", "projection (merger MLP)")):
            if key in base:
                return cat
    if base.startswith(("ln1", "ln2", "post_ln", "pre_ln")):
        return "layer norms"
    if base.startswith(("inp_", "patch_", "pos_")):
        return "patch embedding"
    if base.startswith(("pooled", "soft_emb_norm")):
        return "pool" if base == "pooled" else "projection + soft_emb_norm"
    if base.endswith("_b"):
        return "bias adds"
    if base in ("ffn_inp", "layer_out"):
        return "residual adds"
    if "gelu" in base or "silu" in base:
        return "activation"
    return f"{op} {base}"


class _Profiler:
    """Kernel seconds by _category over runs of compiled graphs (their step functions wrapped, then restored)."""

    def __init__(self, graphs) -> None:
        from hearthlm.runtime import dispatch
        self.by = defaultdict(float)
        self.saved = [(st, st.fn) for cg in graphs for st in cg.steps if st.kind is dispatch.KERNEL]

    def __enter__(self):
        for st, fn in self.saved:
            st.fn = self._wrap(fn, _category(st.node.op.value, st.node.name or ""))
        return self

    def __exit__(self, *exc) -> None:
        for st, fn in self.saved:
            st.fn = fn

    def _wrap(self, fn, key: str):
        def k(*args, **kw):
            t = time.perf_counter()
            r = fn(*args, **kw)
            self.by[key] += time.perf_counter() - t
            return r
        return k


def _encoder(mmproj: str, n_embd_text: int, threads: int):
    import numba

    from hearthlm.backends import get_backend
    from hearthlm.model_zoo.vision.clip import load_mmproj
    from hearthlm.runtime.placement import Placement
    from hearthlm.runtime.vision import VisionEncoder
    numba.set_num_threads(threads)
    t = time.perf_counter()
    vm = load_mmproj(mmproj, n_embd_text=n_embd_text)
    enc = VisionEncoder(vm, Placement.single(get_backend("cpu"), vm.config.n_layer), cache_bytes=0)  # no reuse
    return vm, enc, time.perf_counter() - t


def _encode_once(vm, enc, rgb: np.ndarray, profile: dict | None = None) -> float:
    from hearthlm.model_zoo.vision.image import load_image
    from hearthlm.runtime.request import Media
    pixels, n, key = vm.prepare(load_image(rgb))
    m = Media(start=0, n=n, key=key, pixels=pixels)
    if profile is None:
        t = time.perf_counter()
        enc.fill([m])
        return time.perf_counter() - t
    # every graph the encoder holds: an encode runs in stages of a few layers, a graph each (all
    # compiled by the runs before this one)
    with _Profiler([e.compiled for e in enc.graphs._graphs.values()]) as p:
        t = time.perf_counter()
        enc.fill([m])
        s = time.perf_counter() - t
    profile.update(p.by)
    return s


# ---- llama.cpp's side, a child process driven a line at a time ---------------------------

class _LlamaCpp:
    """vision_llama_cpp.py in `python`: init, then one JSON command a line ("encode", "ttft" with an image)."""

    def __init__(self, python: str, spec: dict, workdir: str) -> None:
        self.err = open(Path(workdir) / "llama_cpp.stderr", "w+")
        spec_path = Path(workdir) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self.p = subprocess.Popen([python, str(Path(__file__).with_name("vision_llama_cpp.py")), str(spec_path)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            self.err.seek(0)
            raise RuntimeError(f"llama.cpp's side stopped ({self.p.wait()}): {self.err.read()[-3000:]}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        self.err.close()


# ---- the measurement ---------------------------------------------------------------------

async def _ttft(s, rgb: np.ndarray, prompt: str) -> float:
    t = time.perf_counter()
    await s.generate(prompt, images=[rgb], max_tokens=1, temperature=0)
    return time.perf_counter() - t


def bench_image(a) -> tuple[list[dict], dict]:
    """Rows (hearthlm, llama.cpp, ratio) and facts about the run (sizes, threads, flash attention, profile)."""
    from threadpoolctl import threadpool_limits

    from hearthlm.session import Session
    threads = a.threads or 2
    if "numba" not in sys.modules:  # the engine's threads (read once, at numba's import): both sides at `threads`
        os.environ["NUMBA_NUM_THREADS"] = str(threads)
    text, mmproj, prompt, side = _files(a)
    from hearthlm.model_zoo.gguf_file import GGUFFile
    with GGUFFile.open(text) as f:
        n_embd = int(f.metadata[f"{f.metadata['general.architecture']}.embedding_length"])
    py = interpreter(a, module="llama_cpp.mtmd_cpp") if a.compare_llama_cpp else None
    if a.compare_llama_cpp and py is None:
        print(f"no interpreter with llama-cpp-python's mtmd bindings (--llama-cpp-python or ${ENV_PYTHON}); "
              "skipping the comparison", file=sys.stderr)
    load_before, load_start = host_line(), load_average()
    with tempfile.TemporaryDirectory(prefix="hearthlm-bench-image-") as tmp:
        vm, enc, load_s = _encoder(mmproj, n_embd, threads)
        size = side or vm.config.image_size
        images = [_image(size, seed) for seed in range(a.repeat + 1)]  # the warm-up's, then each round's
        import numba
        facts = dict(text_model=text, mmproj=mmproj, image_size=size, threads=threads, repeat=a.repeat,
                     engine_threads=numba.config.NUMBA_NUM_THREADS,
                     image_tokens=vm.proj.n_tokens(vm.config, vm.pconfig, size, size))
        with threadpool_limits(limits=1, user_api="blas"):  # as runtime.engine sets while an engine runs
            first = _encode_once(vm, enc, images[0])
        ref = None
        if py:
            for i, px in enumerate(images):
                np.save(Path(tmp) / f"{i}.npy", px)
            ref = _LlamaCpp(py, dict(model=text, mmproj=mmproj, threads=threads, n_ctx=N_CTX, n_batch=512,
                                     prompt=prompt, images=[str(Path(tmp) / f"{i}.npy") for i in range(len(images))]),
                            tmp)
        ours, theirs = dict(encode=[], ttft=[]), dict(encode=[], ttft=[])
        for _ in range(a.repeat):  # rounds in turn: a noisy spell of a shared machine hits both
            with threadpool_limits(limits=1, user_api="blas"):
                ours["encode"].append(_encode_once(vm, enc, images[0]))
            if ref:
                theirs["encode"].append(ref.ask(op="encode")["encode_s"])
        profile: dict[str, float] = {}
        if a.profile:
            with threadpool_limits(limits=1, user_api="blas"):
                facts["profiled_encode_s"] = _encode_once(vm, enc, images[0], profile)
        vm.close()
        del vm, enc

        async def ttft_rounds() -> float:
            t = time.perf_counter()
            async with Session.open(text, options=session_options(a, mmproj=mmproj, n_ctx=N_CTX, backend="cpu")) as s:
                open_s = time.perf_counter() - t
                await _ttft(s, images[0], prompt)  # warm-up: the prefill's graph and kernels
                if ref:
                    ref.ask(op="ttft", image=0)
                for i in range(1, a.repeat + 1):
                    ours["ttft"].append(await _ttft(s, images[i], prompt))
                    if ref:
                        theirs["ttft"].append(ref.ask(op="ttft", image=i)["ttft_s"])
            return open_s
        try:
            session_s = anyio.run(ttft_rounds)
        finally:
            if ref:
                ref.close()
    rows = [dict(engine="hearthlm", load_s=load_s, first_encode_s=first, encode_s=float(np.median(ours["encode"])),
                 ttft_s=float(np.median(ours["ttft"])), session_open_s=session_s, flash_attn="n/a")]
    if ref:
        info = ref.info
        rows.append(dict(engine="llama.cpp", load_s=info["init_s"], first_encode_s=info["first_encode_s"],
                         encode_s=float(np.median(theirs["encode"])), ttft_s=float(np.median(theirs["ttft"])),
                         session_open_s=info["llama_open_s"] + info["init_s"], flash_attn=info["flash_attn"]))
        rows.append(dict(engine="ratio", **{k: rows[0][k] / rows[1][k] for k in ("load_s", "first_encode_s", "encode_s",
                                                                                 "ttft_s", "session_open_s")}))
        facts.update(llama_cpp_python=info["llama_cpp_python"], mtmd_flash_attn_type=info["flash_attn_type"],
                     llama_cpp_image_tokens=info["n_image_tokens"],
                     llama_cpp={k: info[k] for k in ("llama_cpp_python", "system_info", "python")})
    facts.update(host=cpu_facts(), load_start=load_start, load_end=load_average(),
                 host_before=load_before, host_after=host_line(), encode_rounds=ours["encode"],
                 ttft_rounds=ours["ttft"], llama_cpp_encode_rounds=theirs["encode"], llama_cpp_ttft_rounds=theirs["ttft"])
    if profile:
        facts["profile"] = dict(sorted(profile.items(), key=lambda kv: -kv[1]))
    return rows, facts


def print_image(rows: list[dict], facts: dict) -> None:
    print(f"model: {Path(facts['text_model']).name}  mmproj: {Path(facts['mmproj']).name}  image: "
          f"{facts['image_size']}x{facts['image_size']} ({facts['image_tokens']} tokens)  threads: {facts['threads']}"
          + (f" (the session's engine: {facts['engine_threads']}, numba was imported first)"
             if facts.get("engine_threads", facts["threads"]) != facts["threads"] else "")
          + f"  medians of {facts['repeat']}")
    print(facts["host_before"] + f"  isa: {' '.join(facts['host']['isa']) or 'no AVX2'}")
    b = facts.get("llama_cpp")
    if b:
        print(f"llama.cpp: llama-cpp-python {b['llama_cpp_python']} in {b['python']}: {b['system_info']}")
    cols = ["engine", "load_s", "first_encode_s", "encode_s", "ttft_s", "session_open_s", "flash_attn"]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>14.3f}" if isinstance(r.get(c), float) else f"{str(r.get(c, '')):>14}" for c in cols))
    if len(rows) > 1:
        print(f"ratio: hearthlm / llama.cpp (above 1: hearthlm slower); llama.cpp's mtmd flash_attn_type "
              f"{facts['mtmd_flash_attn_type']} (its default; -1 auto) resolved to {rows[1]['flash_attn']}")
    print("load_s: the tower's file opened (llama.cpp: mtmd_init_from_file); first_encode_s: the first image "
          "(hearthlm: graph built and weights packed); ttft_s: \"describe this image\" to its first token")
    if facts.get("profile"):
        total = sum(facts["profile"].values())
        print(f"profile of one encode ({facts['profiled_encode_s']:.3f} s; kernels {total:.3f} s):")
        for k, v in facts["profile"].items():
            print(f"  {k:32} {v:9.3f} s  {100 * v / total:5.1f}%")
    print(facts["host_after"].replace("cpu: ", "after: "))
