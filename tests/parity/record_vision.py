"""Records llama.cpp's image path (libmtmd) on the tiny vision-language models once, under llama-cpp-python
0.3.36 (never in CI; the files come from tests/parity/hf/make.py + convert.py, specs "gemma3-vision",
"qwen35-vision", "qwen3vl-vision", "qwen3vlmoe-vision", "gemma4-vision", "gemma4uv-vision", "smolvlm-vision",
"lfm2-vision" and "mistral3-vision"):

    /tmp/lcp-venv/bin/python tests/parity/record_vision.py [gemma3] [qwen35] [qwen3vl] [qwen3vlmoe] [gemma4] [gemma4uv]
        [smolvlm] [lfm2] [mistral3]

writes tests/data/vision_parity.json (Gemma 3), vision_parity_qwen35.json (Qwen3.5), vision_parity_qwen3vl.json
(Qwen3-VL, whose rows carry deepstack features: n_embd is the text model's input width), vision_parity_qwen3vlmoe.json
(Qwen3-VL MoE, the same), vision_parity_gemma4.json (Gemma 4, projector gemma4v), vision_parity_gemma4uv.json (Gemma
4 12B's encoder-free gemma4uv; its mmproj's audio half, gemma4ua, is loaded by mtmd and unused),
vision_parity_mistral3.json (Ministral 3 with Pixtral: the tower appends
[IMG_BREAK]'s embedding after each row of image rows but the last), vision_parity_smolvlm.json and
vision_parity_lfm2.json (the tiled families: their rows in vision_rows_<family>.npz); under M-RoPE each image
chunk's decoder positions too, and n_past counts positions, not tokens:
- "images": each image's recipe (rgb() below regenerates its pixels with numpy; their sha256 is kept to check
  that), and the rows mtmd_encode_chunk gives for it (n_tokens x n_embd, 6 significant digits); a tiled image's
  chunks (tiles row by row, then the overview) each encoded, their shapes here ("chunk_shapes") and their rows
  in the .npz as "<image>/<k>" (float32);
- "prompts": mtmd_tokenize's chunks (text ids, or an image's n_tokens, n_pos, grid and id), then greedy steps
  as tests/data/arch_parity.json has them (greedy_ids; top-5 ids and log-probs per step) from
  mtmd_helper_eval_chunks (n_past 0, seq 0, logits of the last token) and llama_decode one token at a time,
  and the first step's full log-prob vector;
- Gemma 4 only, "causal" per prompt: the same steps with the image rows decoded causally, as libmtmd decodes
  E2B's and E4B's (mtmd_decode_use_non_causal is false for a text model 1536 or 2560 wide; the tiny one is 32):
  mtmd_helper_eval_chunks' own sequence of batches (eval_causal below) without its non-causal switch;
- "settings": the context's (threads, n_ctx, n_batch, flash attention off, K/V in F32), and whether mtmd
  decodes the image rows with non-causal attention.
Bitmaps are made from raw RGB (mtmd_bitmap_init): no image decoder enters."""
from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).parents[1] / "data"
MODEL, MMPROJ = DATA / "converted" / "gemma3-vision.gguf", DATA / "converted" / "gemma3-vision.mmproj.gguf"
OUT = DATA / "vision_parity.json"
IMAGES = {  # the image size is 64: one at it, one scaled up, one not square (resized keeping its aspect, padded)
    "gradient": {"kind": "gradient", "nx": 64, "ny": 64},
    "noise": {"kind": "noise", "nx": 32, "ny": 32, "seed": 0},
    "wide": {"kind": "noise", "nx": 40, "ny": 24, "seed": 1},
}
M = "<__media__>"  # mtmd_default_marker(), checked below
LONG = " ".join(["The hearth is the heart of the home; people gather around the fire to keep warm."] * 8)  # 335 tokens
PROMPTS = {  # name -> (text, images in marker order)
    "one_image": (f"<start_of_turn>user\n{M}What is in the image?<end_of_turn>\n<start_of_turn>model\n", ["gradient"]),
    "two_images": (f"Compare {M} and {M} please.", ["gradient", "noise"]),
    "image_between_text": (f"The hearth is warm. {M} Hello world!", ["wide"]),
    "long_text_after_image": (f"{M}{LONG}", ["gradient"]),  # 300+ text tokens after it (noise: a 0.007 near-tie)
}
QWEN_IMAGES = {  # patch 4, merge 2: sides to multiples of 8; one square, one small, one resized to 48x24 (6x3 rows)
    "gradient": {"kind": "gradient", "nx": 64, "ny": 64},
    "noise": {"kind": "noise", "nx": 32, "ny": 32, "seed": 0},
    "wide": {"kind": "noise", "nx": 44, "ny": 26, "seed": 1},
}
QWEN_PROMPTS = {
    "one_image": (f"<|im_start|>user\n{M}What is in the image?<|im_end|>\n<|im_start|>assistant\n", ["gradient"]),
    "two_images": (f"Compare {M} and {M} please.", ["gradient", "noise"]),
    "image_between_text": (f"The hearth is warm. {M} Hello world!", ["wide"]),
    "long_text_after_image": (f"{M}{LONG} {LONG.split('. ')[0]}.", ["noise"]),  # 9 sentences: 300+ tokens
}
QWEN25_IMAGES = {  # patch 14, merge 2, llama.cpp's 112-pixel windows of 4x4 rows: an 8x8 grid in four windows,
    "gradient": {"kind": "gradient", "nx": 224, "ny": 224},
    "noise": {"kind": "noise", "nx": 112, "ny": 112, "seed": 0},  # a 4x4 grid, one window
    "wide": {"kind": "noise", "nx": 260, "ny": 150, "seed": 1},  # to 252x140: 9x5 rows, windows cut at the edges
}
LONG10 = f"{LONG} {LONG.split('. ')[0]}. {LONG.split('. ')[0]}."  # 10 sentences: 300+ tokens in these vocabularies
# the tiled families (#39): an image is tiles plus an overview, each its own image chunk; their rows go to an .npz
SMOLVLM_IMAGES = {  # tiles of 32, longest edge 64: a square to 2x2 tiles, a wide one to 2x1, a tall one to 1x2
    "square": {"kind": "gradient", "nx": 48, "ny": 48},
    "wide": {"kind": "noise", "nx": 80, "ny": 30, "seed": 1},
    "tall": {"kind": "noise", "nx": 20, "ny": 50, "seed": 2},
}
SMOLVLM_PROMPTS = {
    "one_image": (f"<|im_start|>User:{M}What is in the image?<end_of_utterance>\nAssistant:", ["square"]),
    "two_images": (f"Compare {M} and {M} please.", ["wide", "tall"]),
    "image_between_text": (f"The hearth is warm. {M} Hello world!", ["tall"]),
    "long_text_after_image": (f"{M}{LONG10}", ["wide"]),
}
LFM2_IMAGES = {  # tiles of 512, patch 16: a big image to 2x1 tiles and a thumbnail; two one-chunk images
    "big": {"kind": "gradient", "nx": 1088, "ny": 544},
    "small": {"kind": "noise", "nx": 300, "ny": 200, "seed": 0},  # 320x224: the 16x16 table to 20x14
    "square": {"kind": "noise", "nx": 256, "ny": 256, "seed": 1},  # the table at its own size
}
LFM2_PROMPTS = {
    "one_image": (f"<|im_start|>user\n{M}What is in the image?<|im_end|>\n<|im_start|>assistant\n", ["big"]),
    "two_images": (f"Compare {M} and {M} please.", ["small", "big"]),
    "image_between_text": (f"The hearth is warm. {M} Hello world!", ["square"]),
    "long_text_after_image": (f"{M}{LONG10}", ["small"]),
}
GEMMA4_PROMPTS = {  # Gemma 4's turns; images upscaled to its 70-row minimum (9x9 rows; the wide one 11x7)
    "one_image": (f"<|turn>user\n{M}What is in the image?<turn|>\n<|turn>model\n", ["gradient"]),
    "two_images": (f"Compare {M} and {M} please.", ["gradient", "noise"]),
    "image_between_text": (f"The hearth is warm. {M} Hello world!", ["wide"]),
    "long_text_after_image": (f"{M}{LONG}", ["gradient"]),
}
MISTRAL3_PROMPTS = {  # Mistral's [INST] turns; QWEN_IMAGES (patch 4, merge 2: sides to multiples of 8, as Pixtral's)
    "one_image": (f"[INST]{M}What is in the image?[/INST]", ["gradient"]),
    "two_images": (f"Compare {M} and {M} please.", ["gradient", "noise"]),
    "image_between_text": (f"The hearth is warm. {M} Hello world!", ["wide"]),
    "long_text_after_image": (f"{M}{LONG10}", ["noise"]),
}
FAMILIES = {  # name -> (model, mmproj, output, images, prompts[, settings, rows file])
    "gemma3": (MODEL, MMPROJ, OUT, IMAGES, PROMPTS),
    "qwen35": (DATA / "converted" / "qwen35-vision.gguf", DATA / "converted" / "qwen35-vision.mmproj.gguf",
               DATA / "vision_parity_qwen35.json", QWEN_IMAGES, QWEN_PROMPTS),
    "qwen3vl": (DATA / "converted" / "qwen3vl-vision.gguf", DATA / "converted" / "qwen3vl-vision.mmproj.gguf",
                DATA / "vision_parity_qwen3vl.json", QWEN_IMAGES, QWEN_PROMPTS),
    "qwen3vlmoe": (DATA / "converted" / "qwen3vlmoe-vision.gguf", DATA / "converted" / "qwen3vlmoe-vision.mmproj.gguf",
                   DATA / "vision_parity_qwen3vlmoe.json", QWEN_IMAGES, QWEN_PROMPTS),
    "qwen25vl": (DATA / "converted" / "qwen25vl-vision.gguf", DATA / "converted" / "qwen25vl-vision.mmproj.gguf",
                 DATA / "vision_parity_qwen25vl.json", QWEN25_IMAGES, QWEN_PROMPTS),
    "smolvlm": (DATA / "converted" / "smolvlm-vision.gguf", DATA / "converted" / "smolvlm-vision.mmproj.gguf",
                DATA / "vision_parity_smolvlm.json", SMOLVLM_IMAGES, SMOLVLM_PROMPTS, {},
                DATA / "vision_rows_smolvlm.npz"),
    "lfm2": (DATA / "converted" / "lfm2-vision.gguf", DATA / "converted" / "lfm2-vision.mmproj.gguf",
             DATA / "vision_parity_lfm2.json", LFM2_IMAGES, LFM2_PROMPTS, {"n_ctx": 2048},
             DATA / "vision_rows_lfm2.npz"),
    "gemma4": (DATA / "converted" / "gemma4-vision.gguf", DATA / "converted" / "gemma4-vision.mmproj.gguf",
               DATA / "vision_parity_gemma4.json", IMAGES, GEMMA4_PROMPTS),
    "gemma4uv": (DATA / "converted" / "gemma4uv-vision.gguf", DATA / "converted" / "gemma4uv-vision.mmproj.gguf",
                 DATA / "vision_parity_gemma4uv.json", IMAGES, GEMMA4_PROMPTS),
    "mistral3": (DATA / "converted" / "mistral3-vision.gguf", DATA / "converted" / "mistral3-vision.mmproj.gguf",
                 DATA / "vision_parity_mistral3.json", QWEN_IMAGES, MISTRAL3_PROMPTS),
}
SETTINGS = {"n_threads": 2, "n_ctx": 512, "n_batch": 512, "n_ubatch": 512, "flash_attn": False,
            "type_k": 0, "type_v": 0}  # GGML_TYPE_F32 = 0
N_STEPS = 8


def rgb(recipe: dict) -> np.ndarray:
    """An image's pixels, (ny, nx, 3) uint8, from its recipe: a gradient (R along x, G along y, B along both,
    each rounded from 0..255) or uniform noise from numpy's default_rng(seed)."""
    nx, ny = recipe["nx"], recipe["ny"]
    if recipe["kind"] == "gradient":
        x, y = np.meshgrid(np.arange(nx), np.arange(ny))
        ch = [x / (nx - 1), y / (ny - 1), (x + y) / (nx + ny - 2)]
        return np.rint(np.stack(ch, axis=-1) * 255).astype(np.uint8)
    return np.random.default_rng(recipe["seed"]).integers(0, 256, size=(ny, nx, 3), dtype=np.uint8)


def _logprobs(logits) -> np.ndarray:
    lp = np.asarray(logits, np.float64)
    lp = lp - lp.max()
    return lp - np.log(np.exp(lp).sum())


def greedy(llm, vocab, n_vocab: int) -> dict:
    """N_STEPS greedy steps from the context's last logits: ids, top-5 and log-probs, the first full vector."""
    import llama_cpp
    ids, steps, first = [], [], None
    for step in range(N_STEPS):
        lp = _logprobs(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)))
        top = np.argsort(-lp, kind="stable")[:5]
        steps.append({"top_ids": [int(t) for t in top], "top_logprobs": [round(float(lp[t]), 5) for t in top]})
        if step == 0:
            first = [round(float(x), 5) for x in lp]
        ids.append(int(top[0]))
        if llama_cpp.llama_vocab_is_eog(vocab, int(top[0])):
            break
        tok = (llama_cpp.llama_token * 1)(int(top[0]))
        assert llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(tok, 1)) == 0
    return {"first_logprobs": first, "greedy_ids": ids, "steps": steps}


def eval_causal(ctx, llm, cs, n_embd: int) -> int:
    """mtmd_helper_eval_chunks (seq 0 from n_past 0, one batch per chunk: each is under n_batch, logits of the
    last token) with every image's rows decoded causally, as mtmd_helper_decode_image_chunk decodes them where
    mtmd_decode_use_non_causal is false. Returns n_past."""
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd
    n_past = 0
    for k, c in enumerate(cs):
        text = mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT
        if text:
            n = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
            n = n.value
        else:
            assert mtmd.mtmd_encode_chunk(ctx, c) == 0
            n = mtmd.mtmd_input_chunk_get_n_tokens(c)
            embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * n_embd,)).copy()
        assert 0 < n <= SETTINGS["n_batch"]
        b = llama_cpp.llama_batch_init(n, 0 if text else n_embd, 1)
        for i in range(n):
            if text:
                b.token[i] = ids[i]
            b.pos[i], b.n_seq_id[i], b.logits[i] = n_past + i, 1, int(k == len(cs) - 1 and i == n - 1)
            b.seq_id[i][0] = 0
        if not text:
            ctypes.memmove(b.embd, embd.ctypes.data, embd.nbytes)
        b.n_tokens = n
        assert llama_cpp.llama_decode(llm.ctx, b) == 0
        llama_cpp.llama_batch_free(b)
        n_past += n
    return n_past


def record(model: Path, mmproj: Path, out_path: Path, images_in: dict, prompts_in: dict, settings: dict | None = None,
           rows_path: Path | None = None) -> None:
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd
    assert mtmd.mtmd_default_marker().decode() == M
    st = {**SETTINGS, **(settings or {})}
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=st["n_ctx"], n_batch=st["n_batch"],
                          n_ubatch=st["n_ubatch"], n_threads=st["n_threads"],
                          n_threads_batch=st["n_threads"], flash_attn=st["flash_attn"],
                          type_k=st["type_k"], type_v=st["type_v"], verbose=False)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu, p.print_timings, p.n_threads, p.warmup = False, False, st["n_threads"], False
    p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, p)
    assert ctx, "mtmd_init_from_file failed"
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab, n_embd = llama_cpp.llama_vocab_n_tokens(vocab), llama_cpp.llama_model_n_embd_inp(llm.model)

    def tokenize(text: str, names: list[str]):
        bitmaps = []
        for n in names:
            px = rgb(images_in[n])
            b = mtmd.mtmd_bitmap_init(px.shape[1], px.shape[0], (ctypes.c_uint8 * px.size).from_buffer_copy(px.tobytes()))
            mtmd.mtmd_bitmap_set_id(b, n.encode())  # the chunk carries it (a cache key, as llama-server's hash)
            bitmaps.append(b)
        chunks = mtmd.mtmd_input_chunks_init()
        inp = mtmd.mtmd_input_text(text=text.encode(), text_len=len(text.encode()), add_special=True, parse_special=True)
        arr = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, len(bitmaps)) == 0
        for b in bitmaps:
            mtmd.mtmd_bitmap_free(b)
        return chunks, [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]

    def describe(c, pos_0: int) -> dict:
        d = {"n_pos": mtmd.mtmd_input_chunk_get_n_pos(c)}
        if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
            return {"type": "text", "tokens": [ids[i] for i in range(n.value)], **d}
        img = mtmd.mtmd_input_chunk_get_tokens_image(c)
        cid = mtmd.mtmd_input_chunk_get_id(c)
        return {"type": "image", "n_tokens": mtmd.mtmd_input_chunk_get_n_tokens(c), **d,
                "nx": mtmd.mtmd_image_tokens_get_nx(img), "ny": mtmd.mtmd_image_tokens_get_ny(img),
                "id": cid.decode() if cid else None,
                "non_causal": bool(mtmd.mtmd_decode_use_non_causal(ctx, c)),
                **({"positions": [[(q := mtmd.mtmd_image_tokens_get_decoder_pos(img, pos_0, i)).t, q.y, q.x, q.z]
                                  for i in range(mtmd.mtmd_input_chunk_get_n_tokens(c))]}
                   if mtmd.mtmd_decode_use_mrope(ctx) else {})}  # (t, y, x, z): M-RoPE's sections in order

    images, npz = {}, {}
    for name, recipe in images_in.items():
        chunks, cs = tokenize(M, [name])
        imgs = [c for c in cs if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
        assert rows_path is not None or len(imgs) == 1, "a tiled image's rows go to the .npz"
        rec = {"recipe": recipe, "sha256": hashlib.sha256(rgb(recipe).tobytes()).hexdigest()}
        shapes = []
        for k, img in enumerate(imgs):  # tiles row by row, then the overview (mtmd's order in the prompt)
            assert mtmd.mtmd_encode_chunk(ctx, img) == 0
            n = mtmd.mtmd_input_chunk_get_n_tokens(img)
            rows = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * n_embd,)).reshape(n, n_embd)
            if rows_path is None:
                rec.update(shape=[n, n_embd], rows=[[float(f"{x:.6g}") for x in r] for r in rows.tolist()])
            else:
                npz[f"{name}/{k}"] = rows.astype(np.float32)
            shapes.append([n, n_embd])
        if rows_path is not None:
            rec["chunk_shapes"] = shapes
        images[name] = rec
        mtmd.mtmd_input_chunks_free(chunks)

    prompts = {}
    for name, (text, names) in prompts_in.items():
        chunks, cs = tokenize(text, names)
        starts = np.cumsum([0] + [mtmd.mtmd_input_chunk_get_n_pos(c) for c in cs])
        rec = {"text": text, "images": names, "chunks": [describe(c, int(p0)) for c, p0 in zip(cs, starts)]}
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, llm.ctx, chunks, 0, 0, st["n_batch"], True,
                                            ctypes.byref(n_past)) == 0
        rec["n_past"] = n_past.value
        rec.update(greedy(llm, vocab, n_vocab))
        if out_path.name == "vision_parity_gemma4.json":  # E2B/E4B's causal image rows, on the same model
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            assert eval_causal(ctx, llm, cs, n_embd) == n_past.value
            rec["causal"] = greedy(llm, vocab, n_vocab)
        prompts[name] = rec
        mtmd.mtmd_input_chunks_free(chunks)

    long = prompts["long_text_after_image"]["chunks"]
    last = max(i for i, c in enumerate(long) if c["type"] == "image")
    n_long = sum(len(c.get("tokens", [])) for c in long[last + 1:])
    assert n_long >= 300, n_long
    out = {"llama_cpp_python": llama_cpp.__version__, "model": model.name, "mmproj": mmproj.name,
           "settings": {**st, "mtmd_flash_attn_type": int(p.flash_attn_type), "n_steps": N_STEPS},
           "marker": M, "n_embd": n_embd, "n_vocab": n_vocab,
           "non_causal": bool(mtmd.mtmd_decode_use_non_causal(ctx, None)),
           "mrope": bool(mtmd.mtmd_decode_use_mrope(ctx)), "images": images, "prompts": prompts}
    mtmd.mtmd_free(ctx)
    llm.close()
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", out_path)
    if rows_path is not None:
        np.savez_compressed(rows_path, **npz)
        print("wrote", rows_path)


if __name__ == "__main__":
    import sys
    for fam in sys.argv[1:] or list(FAMILIES):
        record(*FAMILIES[fam])
