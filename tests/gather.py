"""Requests run at once or one after another, the two ways the batch-invariance tests compare; the
draft model's proposals recorded."""
import anyio


async def run_all(one, n: int, together: bool) -> None:
    """await one(i) for i < n: all at once in a task group (one batch), or one after another."""
    if together:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    else:
        for i in range(n):
            await one(i)


def record_drafts(monkeypatch) -> list:
    """Every draft the session's draft model proposes, as (the request's tokens, the draft), in order."""
    from hearthlm.runtime.draft import DraftModel
    seen = []
    propose = DraftModel.propose

    def recording(self, items):
        propose(self, items)
        seen.extend((list(r.tokens), list(r.draft)) for r, _ in items if r.draft)
    monkeypatch.setattr(DraftModel, "propose", recording)
    return seen
