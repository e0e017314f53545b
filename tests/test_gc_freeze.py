"""Session.open freezes the objects alive after loading (sdk/gc_freeze.py), so that the
collector's full walks skip numba's and the model's: without it a gen-2 collection in any thread
held the GIL 50-75 ms, and tests/test_event_loop.py's 2,000-message chat phase stalled the loop
72-117 ms in 12 of 15 runs here (whichever files were restored: it is where a collection lands).
Closing thaws; other open sessions keep the freeze."""
from __future__ import annotations

import gc

from hearthlm import Session


async def test_open_freezes_close_thaws(smollm2_path):
    """Mutations: aclose not thawing (the count stays after the last close), thawing without
    freezing again while another session is open (0 after the first close), or freezing whatever
    gc_freeze says (a count with gc_freeze=False), each fail it."""
    assert gc.get_freeze_count() == 0
    async with Session.open(str(smollm2_path), n_ctx=256) as a:
        n = gc.get_freeze_count()
        assert n > 50_000  # numba's kernels and the model: the bulk of the process's objects
        async with Session.open(str(smollm2_path), n_ctx=256):
            assert gc.get_freeze_count() >= n
        assert gc.get_freeze_count() > 0  # `a` is still open
        assert (await a.generate("Hi", max_tokens=2, temperature=0)).token_ids
    assert gc.get_freeze_count() == 0
    async with Session.open(str(smollm2_path), n_ctx=256, gc_freeze=False):
        assert gc.get_freeze_count() == 0


async def test_a_full_collection_after_open_walks_little(smollm2_path):
    """What the freeze buys: a full collection with the session open walks a small fraction of
    the objects it would walk thawed. Mutation: freezing before the load (nothing of the model
    frozen) fails it."""
    async with Session.open(str(smollm2_path), n_ctx=256) as s:
        await s.generate("Hi", max_tokens=2, temperature=0)
        walked = len(gc.get_objects())  # the tracked objects outside the permanent generation
        assert walked < gc.get_freeze_count() / 2, (walked, gc.get_freeze_count())
