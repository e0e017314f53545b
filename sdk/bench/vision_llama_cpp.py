"""llama.cpp's side of `hearthlm bench --image`, run as a script by an interpreter that has
llama-cpp-python (never imported by hearthlm; it imports nothing of hearthlm):

    python vision_llama_cpp.py SPEC.json

SPEC: model, mmproj, threads, n_ctx, n_batch, prompt (with mtmd's default marker), images (.npy
files of (H, W, 3) uint8). It opens both files, encodes images[0] once and prints one JSON line:
llama_open_s (the text model), init_s (mtmd_init_from_file: the tower's weights and llama.cpp's
warm-up graph reservation), first_encode_s, n_image_tokens, flash_attn_type (the mtmd context
parameter, left at llama.cpp's default) and flash_attn (what clip.cpp's warm-up resolved it to,
read from its log), and the build (llama_cpp_side.build: llama_cpp_python, system_info, python).
Then it answers one JSON line per command line on stdin:
{"op": "encode"}: mtmd_encode_chunk of images[0]'s chunk -> {"encode_s"};
{"op": "ttft", "image": i}: bitmap, mtmd_tokenize, mtmd_helper_eval_chunks and a greedy sample
from an empty context -> {"ttft_s"}. It ends when stdin closes."""
from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time

import numpy as np
from llama_cpp_side import build  # beside this script: the build's facts, as every bench child reports them


def _stderr_to(path: str) -> int:
    """Point fd 2 (where clip.cpp logs) at `path`; returns the old fd to restore."""
    old = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    return old


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = os.fdopen(os.dup(1), "w")  # the answers' channel; anything llama.cpp prints goes to stderr
    os.dup2(2, 1)
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd
    th = spec["threads"]
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_batch=spec["n_batch"],
                          n_ubatch=spec["n_batch"], n_threads=th, n_threads_batch=th, verbose=False)
    open_s = time.perf_counter() - t
    p = mtmd.mtmd_context_params_default()
    fa_type = int(p.flash_attn_type)  # llama.cpp's default, kept
    p.use_gpu, p.print_timings, p.n_threads = False, False, th
    log = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
    old = _stderr_to(log)
    try:
        t = time.perf_counter()
        ctx = mtmd.mtmd_init_from_file(spec["mmproj"].encode(), llm.model, p)
        init_s = time.perf_counter() - t
    finally:
        os.dup2(old, 2)
        os.close(old)
    with open(log, errors="replace") as f:
        text = f.read()
    os.unlink(log)
    if not ctx:
        raise SystemExit(f"mtmd_init_from_file failed:\n{text[-3000:]}")
    fa = "enabled" if "flash attention is enabled" in text else "disabled" if "flash attention is disabled" in text \
        else "unknown"
    lctx = llm.ctx
    smpl = llama_cpp.llama_sampler_init_greedy()

    def tokenize(px: np.ndarray):
        b = mtmd.mtmd_bitmap_init(px.shape[1], px.shape[0], (ctypes.c_uint8 * px.size).from_buffer_copy(px.tobytes()))
        chunks = mtmd.mtmd_input_chunks_init()
        raw = spec["prompt"].encode()
        inp = mtmd.mtmd_input_text(text=raw, text_len=len(raw), add_special=True, parse_special=True)
        arr = (mtmd.mtmd_bitmap_p_ctypes * 1)(b)
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, 1) != 0:
            raise SystemExit("mtmd_tokenize failed")
        mtmd.mtmd_bitmap_free(b)
        return chunks

    def image_chunk(chunks):
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            c = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return c
        raise SystemExit("the prompt gave no image chunk")

    def encode(c) -> float:
        t = time.perf_counter()
        if mtmd.mtmd_encode_chunk(ctx, c) != 0:
            raise SystemExit("mtmd_encode_chunk failed")
        return time.perf_counter() - t

    def ttft(px: np.ndarray) -> float:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lctx), True)
        t = time.perf_counter()
        chunks = tokenize(px)
        n_past = llama_cpp.llama_pos(0)
        if mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, spec["n_batch"], True, ctypes.byref(n_past)) != 0:
            raise SystemExit("mtmd_helper_eval_chunks failed")
        llama_cpp.llama_sampler_sample(smpl, lctx, -1)
        s = time.perf_counter() - t
        mtmd.mtmd_input_chunks_free(chunks)
        return s

    images = [np.load(f) for f in spec["images"]]
    chunks = tokenize(images[0])
    c = image_chunk(chunks)
    first = encode(c)
    print(json.dumps(dict(llama_open_s=open_s, init_s=init_s, first_encode_s=first,
                          n_image_tokens=mtmd.mtmd_input_chunk_get_n_tokens(c), flash_attn_type=fa_type,
                          flash_attn=fa, **build())), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        res = dict(encode_s=encode(c)) if cmd["op"] == "encode" else dict(ttft_s=ttft(images[cmd["image"]]))
        print(json.dumps(res), file=out, flush=True)
    mtmd.mtmd_input_chunks_free(chunks)
    llama_cpp.llama_sampler_free(smpl)
    mtmd.mtmd_free(ctx)
    llm.close()


if __name__ == "__main__":
    main()
