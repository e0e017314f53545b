"""How an architecture reads its weights: each one where it is used, with the shape it expects
(llama.cpp's create_tensor). `Weights` checks them against the file, so a missing or misshapen
tensor is named at load (the loader builds a one-token graph); `specs` runs the same build over
placeholders to list what an architecture reads, which the tiny-model writer writes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import gguf
import numpy as np

from hearthlm.core.errors import ModelLoadError
from hearthlm.core.graph import Graph, Tensor
from hearthlm.core.weights import QWeight, RowTable
from hearthlm.runtime.batch import one_token

_NO_BYTES = np.zeros(0, np.uint8)


@dataclass(frozen=True)
class Spec:
    name: str               # the GGUF tensor name
    shape: tuple[int, ...]  # numpy order: (rows, cols), (n,), or (n_expert, rows, cols)
    optional: bool = False  # biases, output.weight (tied to token_embd), RoPE factors


class Weights:
    """`w(name, shape)` -> the weight's graph node. `optional`: None when the file has no such
    tensor; `fallback`: another tensor of the same shape read in its place (a tied LM head);
    `rows`: a view of rows start..stop (Phi-3's gate and up halves of ffn_up); `flat`: a float
    tensor of any shape as one vector (what backends keep as plain floats for elementwise use);
    `by_row`: a table the graph only reads rows of (core.weights.RowTable: backends may leave it in the file)."""

    def __init__(self, g: Graph, tensors: Mapping[str, QWeight] | None, n_vocab: int, *, where: str = "",
                 arch: str = "", views: dict | None = None) -> None:
        self.g, self.n_vocab, self.where, self.arch = g, n_vocab, where, arch
        self.tensors = tensors  # None: record specs, build over placeholders
        self.specs: dict[str, Spec] = {}
        self._views = {} if views is None else views

    def __call__(self, name: str, shape, *, optional: bool = False, fallback: str | None = None,
                 rows: tuple[int, int] | None = None, flat: bool = False, by_row: bool = False) -> Tensor | None:
        shape = tuple(int(s) for s in shape)
        if self.tensors is None:
            qw = self._record(name, shape, optional or fallback is not None)
        else:
            qw = self.tensors.get(name) or (self.tensors.get(fallback) if fallback else None)
            if qw is None:
                if optional:
                    return None
                raise ModelLoadError(f"{self.where}: tensor {name!r} is missing ({self.arch} architecture)")
            if tuple(qw.shape) != shape:
                raise ModelLoadError(f"{self.where}: tensor {qw.name!r} has shape {tuple(qw.shape)}; the {self.arch} "
                                     f"architecture expects {shape}")
        if rows is not None:
            qw = self._view(f"{qw.name}[{rows[0]}:{rows[1]}]", qw, (rows[1] - rows[0], *qw.shape[1:]),
                            lambda r: r[rows[0]:rows[1]])
        if flat and len(qw.shape) > 1:
            qw = self._view(f"{qw.name}[flat]", qw, (int(np.prod(qw.shape)),), lambda r: r.reshape(-1), floats=True)
        if by_row:
            qw = RowTable(qw.name, qw.ggml_type, qw.shape, qw.raw)
        return self.g.weight(qw)

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        """The file's shape of a tensor (None: absent, or recording specs), for an architecture
        whose tensors come in more than one layout (llama.cpp's get_tensor_meta)."""
        qw = None if self.tensors is None else self.tensors.get(name)
        return None if qw is None else tuple(qw.shape)

    def layer(self, il: int):
        """`L = w.layer(il)`; `L("attn_q.weight", shape)` reads blk.{il}.attn_q.weight."""
        return lambda name, shape, **kw: self(f"blk.{il}.{name}", shape, **kw)

    def _record(self, name: str, shape: tuple[int, ...], optional: bool) -> QWeight:
        s = self.specs.setdefault(name, Spec(name, shape, optional))
        assert s.shape == shape, f"{name} declared as {s.shape} and as {shape}"
        return QWeight(name, 0, shape, _NO_BYTES)

    def _view(self, key: str, qw: QWeight, shape, part, floats: bool = False) -> QWeight:
        """A view of the file's bytes made once per model (the weight stores key weights by name)."""
        if self.tensors is None:
            return QWeight(key, 0, shape, _NO_BYTES)
        if key not in self._views:
            raw, kind = part(qw.raw), qw.ggml_type
            if floats and kind not in (0, 1):  # an elementwise weight kept quantized (BERT's token types): as f32
                try:
                    raw, kind = gguf.quants.dequantize(raw, kind).astype(np.float32).reshape(1, -1).view(np.uint8), 0
                except (NotImplementedError, ValueError, KeyError) as e:
                    raise ModelLoadError(f"{self.where}: tensor {qw.name!r} of ggml type {kind} cannot be read as "
                                         f"floats: {e}") from e
            self._views[key] = QWeight(key, kind, tuple(shape), raw)
        return self._views[key]


def specs(arch, cfg, n_vocab: int) -> list[Spec]:
    """Every tensor `arch.build` reads, in the order it first reads them."""
    w = Weights(Graph(), None, n_vocab)
    arch.build(cfg, w.g, w, one_token(n_state=2 if any(m.state for m in cfg.layer_memory()) else 0))
    return list(w.specs.values())
