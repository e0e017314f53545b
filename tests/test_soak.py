"""The soak (tests/soak.py) in short: 120 mixed requests at concurrency 24 on SmolLM2; every
one ends in a result or a HearthError, nothing is left in the engine, RSS stays flat after
the warm-up and greedy outputs are unchanged. `make soak` runs the full 600."""
from soak import check, soak


async def test_short_soak(smollm2_path):
    r = await soak(str(smollm2_path), n=120, concurrency=24)
    print(r)
    assert not check(r), (check(r), r)
    kinds = {k for k, _ in r["outcomes"]}
    assert {"normal", "cancel", "timeout", "invalid", "too_long"} <= kinds  # the mix did happen
    assert all(o == "ok" for (k, o) in r["outcomes"] if k == "normal")
    assert all(o == "InvalidRequestError" for (k, o) in r["outcomes"] if k == "invalid")
    assert all(o == "ContextLengthError" for (k, o) in r["outcomes"] if k == "too_long")
