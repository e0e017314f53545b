"""Stop strings on the stream's text (sdk/output.py): the cut at the first stop string, and the
tail held back because it could begin one, against a plain reference on random short texts."""
import random

from hearthlm.output import _cut_at_stop


def reference(before: str, new: str, stops: list[str], final: bool) -> tuple[str, str, str]:
    """What the stream must do: cut at the earliest stop found across the boundary (`before`
    as far back as a stop could reach; only the text from `new` is emitted), else hold the
    longest tail of new that is a proper prefix of some stop (nothing held at the end)."""
    before = before[max(len(before) - (max(map(len, stops)) - 1), 0):]
    joined = before + new
    hits = [(i, s) for s in stops if (i := joined.find(s)) >= 0]
    if hits:
        i, s = min(hits)
        return new[:max(i - len(before), 0)], "", s
    if final:
        return new, "", ""
    hold = max((k for s in stops for k in range(1, min(len(s) - 1, len(new)) + 1) if new.endswith(s[:k])), default=0)
    return new[:len(new) - hold], new[len(new) - hold:], ""


def test_cut_and_hold_match_the_reference():
    """60,000 random cases over a 4-letter alphabet (stops of 1-6 characters). Mutation:
    trying only the first place in new's tail where a stop's first character occurs (not the
    later ones) fails it, e.g. stop "abca" after "zaba" holds nothing instead of "a"."""
    rnd = random.Random(7)
    text = lambda lo, hi: "".join(rnd.choice("ab c") for _ in range(rnd.randint(lo, hi)))  # noqa: E731
    for _ in range(30000):
        stops = [text(1, 6) for _ in range(rnd.randint(1, 4))]
        before, new = text(0, 8), text(0, 8)
        for final in (False, True):
            assert _cut_at_stop(before, new, stops, final=final) == reference(before, new, stops, final), \
                (before, new, stops, final)
    assert _cut_at_stop("", "zaba", ["abca"], final=False) == ("zab", "a", "")
