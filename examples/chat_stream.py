"""Stream a chat reply token by token; several questions run concurrently in one batch."""
import sys

import anyio

from hearthlm import Session

QUESTIONS = ["What is a hearth?", "Name a warm drink.", "Why is the sky blue?"]


async def main(model: str = "smollm2-135m-instruct") -> None:
    async with Session.open(model, n_ctx=1024) as s:
        answers: dict[str, str] = {}

        async def ask(q: str) -> None:
            parts = []
            async for chunk in s.stream(messages=[{"role": "user", "content": q}], max_tokens=40, temperature=0):
                parts.append(chunk.text)
                if q == QUESTIONS[0]:  # show one answer live
                    print(chunk.text, end="", flush=True)
            answers[q] = "".join(parts)

        async with anyio.create_task_group() as tg:
            for q in QUESTIONS:
                tg.start_soon(ask, q)
        print()
        for q in QUESTIONS[1:]:
            print(f"Q: {q}\nA: {answers[q]}")


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:2])
