"""A copy of a GGUF file with every tensor dequantized to F32 (gguf-py's own dequantization, not
hearthlm's): the same weights, which llama.cpp then multiplies in float32 instead of rounding
the activations to 8 bits for its quantized dot products. record_dequantized.py records the
goldens' reference log-probs on such copies.
  python tests/parity/dequantize.py IN.gguf OUT.gguf"""
from __future__ import annotations

import sys

import gguf
import numpy as np

SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # written by the writer itself


def dequantize(src: str, dst: str) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key in SKIP or key == "general.architecture" or key == "general.alignment":
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub)
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # (rows..., n_per_row)
        w.add_tensor(t.name, a.reshape([int(d) for d in reversed(t.shape)]), raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    dequantize(sys.argv[1], sys.argv[2])
