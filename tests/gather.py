"""Requests run at once or one after another, the two ways the batch-invariance tests compare."""
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
