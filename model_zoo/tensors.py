"""What tensors an architecture reads, with their shapes (llama.cpp's load_arch_tensors):
the loader checks a file against it, so a missing or misshapen tensor is named at load, and
the tiny-model test runner writes files from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hearthlm.runtime.errors import ModelLoadError


@dataclass(frozen=True)
class Spec:
    name: str               # the GGUF tensor name
    shape: tuple[int, ...]  # numpy order: (rows, cols), (n,), or (n_expert, rows, cols)
    optional: bool = False  # biases, output.weight (tied to token_embd), RoPE factors


def layer_specs(n_layer: int, per_layer: Mapping[str, tuple[int, ...]], *, optional: bool = False) -> list[Spec]:
    return [Spec(f"blk.{il}.{name}", tuple(shape), optional) for il in range(n_layer) for name, shape in per_layer.items()]


def check(specs: list[Spec], shapes: Mapping[str, tuple[int, ...]], *, path: str, arch: str) -> None:
    """Every required tensor present, every present one of the described shape."""
    for s in specs:
        got = shapes.get(s.name)
        if got is None:
            if not s.optional:
                raise ModelLoadError(f"{path}: tensor {s.name!r} is missing ({arch} architecture)")
        elif tuple(got) != s.shape:
            raise ModelLoadError(f"{path}: tensor {s.name!r} has shape {tuple(got)}; the {arch} architecture "
                                 f"expects {s.shape}")
