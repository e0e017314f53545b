"""The Backend protocol. A backend runs one graph node at a time on arrays it owns;
`runtime.dispatch` walks the graph, keeps values alive only as long as needed, and calls
`run`. Backends import nothing of ours but the graph's op definitions."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from hearthlm.runtime.graph import Op, Tensor
from hearthlm.runtime.weights import QWeight

Kernel = Callable[..., Any]  # kernel(node, *src_values) -> value


class Backend(Protocol):
    name: str
    kernels: dict[Op, Kernel]

    def prepare_weight(self, w: QWeight) -> Any:
        """Repack/upload a weight once; the result is what kernels receive for WEIGHT nodes."""

    def supports(self, node: Tensor) -> bool:
        """Whether this backend can run `node` (op and weight type)."""

    def to_host(self, value: Any) -> Any:
        """A numpy view of a value (identity on CPU backends)."""

    def from_host(self, array: Any) -> Any:
        """Place a numpy array where this backend's kernels read it."""
