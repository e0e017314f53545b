"""Random LoRA adapters of a base model, written as llama.cpp's convert_lora_to_gguf.py writes
them: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and `<base tensor>.lora_a`
(rank, n_in) / `.lora_b` (n_out, rank) in numpy order (GGUF ne reversed) for each adapted 2-D
weight. `hearthlm bench --lora` times them at a real model's shapes; the tests write them for
the tiny models (tests/parity/record_lora.py)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from hearthlm.model_zoo.gguf_file import GGUFFile

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # PEFT's usual


def write_lora(path: Path, base: Path, *, seed: int, rank: int = 4, alpha: float = 8.0, size: float = 0.5,
               targets=TARGETS, output: bool = False, qtype=None, arch: str | None = None,
               shapes: dict | None = None) -> Path:
    """An adapter of `base` (a GGUF path) on the blocks' `targets` (and the LM head with `output`);
    B scaled so that the adapter moves the logits visibly (`size`: the product's scale against the
    weight's). `qtype`: A and B stored as that type (F16, BF16, Q8_0) instead of F32; `arch`: the
    architecture written (a foreign adapter); `shapes`: {tensor name: shape} written in place of
    the right ones (an adapter that lies about its shapes)."""
    rng = np.random.default_rng(seed)
    with GGUFFile.open(base) as f:
        model_arch = f.architecture
        tensors = {n: t.shape for n, t in f.tensors.items()}
    w = gguf.GGUFWriter(str(path), arch or model_arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, shape in tensors.items():
        stem = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        if len(shape) != 2 or not (stem in targets and name.startswith("blk.") or output and name == "output.weight"):
            continue
        n_out, n_in = shape
        a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
        b = size * rng.standard_normal((n_out, rank)) / np.sqrt(rank)
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            data = np.ascontiguousarray(data, np.float32)
            data = data.reshape((shapes or {}).get(name + suffix, data.shape)) if shapes and name + suffix in shapes \
                else data
            if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name + suffix, data)
            elif qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name + suffix, data.astype(np.float16))
            else:
                w.add_tensor(name + suffix, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
