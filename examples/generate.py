"""Generate a completion with the default model (or the one named on the command line)."""
import sys

import anyio

from hearthlm import Session


async def main(model: str = "smollm2-135m-instruct") -> None:
    async with Session.open(model, n_ctx=1024) as s:
        c = await s.generate("The three most useful things to keep near a hearth are", max_tokens=48,
                             temperature=0.7, seed=42)
        print(c.text)
        print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:2])
