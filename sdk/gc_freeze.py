"""The cyclic garbage collector and a loaded model. numba's kernels, the model and its graphs are
some 160,000 objects that live as long as the session; a full collection walks them all
(50-75 ms on 2 cores) holding the GIL, and so stalls every thread, the application's event loop
included, at whatever allocation happens to trigger it (a chat template's rendering, a sampled
token). Session.open freezes what is alive once the model is loaded (gc.freeze: out of the
collector's walks, still freed by reference counting), so later collections walk only what came
after; closing a session unfreezes, and freezes again while other sessions stay open.
Neither collects: a full collection walks the whole application's heap (~0.5 s for 2 million
objects), which an app that opens and closes sessions (a model router, a test suite) would pay at
every open and close; cyclic garbage frozen meanwhile is collected after the last close, by the
collector's own next full pass. SessionOptions(gc_freeze=False) leaves the collector alone."""
from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_frozen = 0  # open sessions that froze


def freeze() -> None:
    """After a session's load: freeze everything alive (O(1): the generations are moved whole)."""
    global _frozen
    with _lock:
        _frozen += 1
        gc.freeze()


def thaw() -> None:
    """At a freezing session's close: its objects (and the application's, frozen with them) back
    to the collector, frozen again where other sessions are open."""
    global _frozen
    with _lock:
        _frozen = max(0, _frozen - 1)
        gc.unfreeze()
        if _frozen:
            gc.freeze()
