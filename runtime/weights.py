"""Model parameters as they sit in the GGUF file (mmap'd, not copied). Backends turn a
QWeight into their own layout once, with `Backend.prepare_weight`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class QWeight:
    name: str              # GGUF tensor name, e.g. "blk.0.attn_q.weight"
    ggml_type: int         # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: (n_rows, n_cols) for matrices, (n,) for vectors
    raw: np.ndarray        # uint8 (n_rows, row_bytes), read-only view of the file

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)
