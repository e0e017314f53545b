"""Requests run at once or one after another, the two ways the batch-invariance tests compare; the
draft model's and head drafters' proposals recorded."""
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


def record_head_drafts(monkeypatch, drafter, seq_cls, seq, k: int | None = None, replace=None) -> dict[int, list[int]]:
    """A head drafter's (runtime.draft_heads: `drafter` its class, `seq_cls` its requests' state's, `seq(self,
    k)` one of fixed draft length k) proposals by the request's token count; `k`: a fixed draft length (no
    adapting to what is kept); `replace(r)`: the drafts the target then verifies instead (the drafter's
    own are recorded first)."""
    seen: dict[int, list[int]] = {}
    propose = drafter.propose

    def recording(self, items):
        propose(self, items)
        for r, _ in items:
            seen[len(r.tokens)] = list(r.draft)
            if replace is not None:
                r.draft = replace(r)
    monkeypatch.setattr(drafter, "propose", recording)
    if k is not None:
        monkeypatch.setattr(drafter, "new_seq", lambda self: seq(self, k))
        monkeypatch.setattr(seq_cls, "feedback", lambda self, n, kept: None)
    return seen
