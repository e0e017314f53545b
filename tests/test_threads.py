"""The engine's thread-count choice (runtime.threads): it follows the measured step times,
switching when the machine changes, and tries the other count only now and then."""
from hearthlm.runtime.threads import MAX_EVERY, ThreadTuner


def run(tuner: ThreadTuner, cost: dict[int, float], steps: int, key="decode") -> list[int]:
    picks = []
    for _ in range(steps):
        n = tuner.pick(key)
        tuner.done(key, n, cost[n])
        picks.append(n)
    return picks


def test_picks_the_faster_count_and_explores_rarely():
    t = ThreadTuner((2, 1))
    picks = run(t, {2: 0.010, 1: 0.018}, 400)
    assert picks[0] == 2  # the warm-up run: not measured
    assert picks[-100:].count(1) <= 3  # mostly the faster
    assert 1 in picks[100:]  # but it still looks at the other now and then
    assert picks.count(1) / len(picks) < 0.06


def test_follows_a_competitor_coming_and_going():
    t = ThreadTuner((2, 1))
    run(t, {2: 0.010, 1: 0.018}, 100)
    busy = run(t, {2: 0.080, 1: 0.020}, 100)  # another process takes a core: 2 threads stall
    assert busy[-80:].count(1) >= 78
    quiet = run(t, {2: 0.010, 1: 0.018}, 2 * MAX_EVERY)  # it leaves: back to 2 within one try
    assert quiet[-MAX_EVERY:].count(2) >= MAX_EVERY - 3


def test_shapes_are_tuned_apart_and_single_choices_untouched():
    t = ThreadTuner((2, 1))
    run(t, {2: 0.010, 1: 0.018}, 60, key="decode")
    run(t, {2: 0.050, 1: 0.020}, 60, key="prefill")
    assert t.pick("decode") == 2 and t.pick("prefill") == 1
    one = ThreadTuner(())
    assert one.pick("x") is None
    one.done("x", None, 1.0)
    assert one.switches == 0
