"""engine/threads.py: the decode thread count follows the launches' timings (fake clocks, no sleeps)."""

from __future__ import annotations

import pytest

from foveal.engine.threads import ThreadChooser


def _run(chooser: ThreadChooser, cost, launches: int, tokens: int = 1) -> list[int]:
    """Make `launches` launches of `tokens` tokens, each taking cost(threads, index) seconds."""
    picked = []
    for index in range(launches):
        threads = chooser.pick()
        picked.append(threads)
        chooser.observe(tokens, threads, cost(threads, index))
    return picked


def test_counts_are_one_the_powers_of_two_below_and_the_most():
    assert ThreadChooser(1).counts == [1]
    assert ThreadChooser(2).counts == [1, 2]
    assert ThreadChooser(6).counts == [1, 2, 4, 6]
    assert ThreadChooser(16).counts == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="most, period and burst >= 1"):
        ThreadChooser(0)


def test_one_thread_never_probes():
    assert set(_run(ThreadChooser(1, period=4, burst=2), lambda t, i: 1.0, 50)) == {1}


def test_moves_to_two_threads_where_they_are_faster_and_stays():
    chooser = ThreadChooser(2, period=100, burst=5)
    picked = _run(chooser, lambda t, i: 0.030 if t == 1 else 0.020, 300)
    assert picked[:6] == [1] * 6  # one warm-up launch (the first ever), then five timed ones
    assert picked[6:12] == [2] * 6  # a burst: one warm-up launch and five timed ones
    assert chooser.choice == 2
    # from 2 the neighbour is 1: probed once a period, and it loses every time
    assert picked[12:].count(2) >= len(picked[12:]) - 2 * 6


def test_stays_on_one_thread_where_two_are_slower_and_probes_once_a_period():
    chooser = ThreadChooser(2, period=100, burst=5)
    picked = _run(chooser, lambda t, i: 0.030 if t == 1 else 0.045, 1000)
    assert chooser.choice == 1
    probes = picked.count(2)
    assert probes <= 6 * (1 + 1000 // (100 + 6 + 1))  # burst + 1 per period, after the first
    assert probes >= 6 * 2  # it keeps looking


def test_a_small_gain_within_the_margin_does_not_move_it():
    chooser = ThreadChooser(2, period=50, burst=5, margin=0.05)
    _run(chooser, lambda t, i: 0.030 if t == 1 else 0.029, 200)  # 3% faster: under the margin
    assert chooser.choice == 1


def test_follows_a_change_of_load():
    chooser = ThreadChooser(2, period=40, burst=5)
    # quiet first (two threads win), then loaded from launch 200 on (one thread wins)
    picked = _run(chooser, lambda t, i: (0.020 if t == 2 else 0.030) if i < 200 else (0.060 if t == 2 else 0.035), 400)
    assert picked[150:200].count(2) >= 50 - 2 * 6  # two threads but for a probe burst of one
    assert chooser.choice == 1
    assert picked[300:].count(1) >= 100 - 3 * 6  # back on one thread, probing two once a period


def test_a_much_slower_count_is_dropped_at_its_first_timed_launch_and_probed_ever_less_often():
    chooser = ThreadChooser(2, period=50, burst=5, most_period=400)
    picked = _run(chooser, lambda t, i: 0.030 if t == 1 else 0.060, 2000)  # an oversubscribed machine
    bursts = [i for i in range(1, len(picked)) if picked[i] == 2 and picked[i - 1] == 1]
    assert all(picked[i : i + 3] == [2, 2, 1] for i in bursts)  # warm-up, one timed launch, back
    gaps = [b - a for a, b in zip(bursts, bursts[1:], strict=False)]
    # two launches of the burst, one untimed back on one thread, then the period: doubled each time
    assert gaps[:4] == [3 + 100, 3 + 200, 3 + 400, 3 + 400]
    assert chooser.choice == 1


def test_a_warm_up_launch_far_slower_still_ends_the_burst():
    chooser = ThreadChooser(2, period=50, burst=5)
    picked = _run(chooser, lambda t, i: 0.030 if t == 1 else 1.0, 100)
    assert picked[6:8] == [2, 1]  # abort**2 times the choice's median already on the warm-up launch


def test_a_won_burst_puts_the_period_back():
    chooser = ThreadChooser(2, period=20, burst=3, most_period=1000)
    # two threads lose at first (bursts back off to periods of 40, 80, 160...), then win from launch 300
    picked = _run(chooser, lambda t, i: (0.030 if t == 1 else 0.045) if i < 300 else (0.030 if t == 1 else 0.015), 700)
    assert chooser.choice == 2
    won = next(i for i in range(300, 700) if picked[i : i + 4] == [2, 2, 2, 2])  # the winning burst
    after = picked[won + 4 :]
    assert 1 in after[: 20 + 2]  # the next burst (of one thread) comes one period of 20 later


def test_times_are_compared_token_count_by_token_count():
    """Decode rows (10 ms) and 4-token verify steps (30 ms) in turn: two threads 20% faster on both.
    A median over the mixed launches would compare whichever sizes each window happened to hold."""
    chooser = ThreadChooser(2, period=100, burst=4)
    for index in range(60):
        tokens = 1 if index % 3 else 4
        threads = chooser.pick()
        base = 0.010 if tokens == 1 else 0.030
        chooser.observe(tokens, threads, base * (0.8 if threads == 2 else 1.0))
    assert chooser.choice == 2


def test_a_burst_with_no_token_count_in_common_changes_nothing():
    chooser = ThreadChooser(2, period=10, burst=3, most_period=1000)
    picked = []
    for _ in range(40):
        threads = chooser.pick()
        picked.append(threads)
        # the choice only ever meets 1-token launches, the bursts only 4-token ones
        chooser.observe(4 if threads == 2 else 1, threads, 0.001 if threads == 2 else 0.010)
    assert chooser.choice == 1 and chooser.bursts >= 2
    bursts = [i for i in range(1, len(picked)) if picked[i] == 2 and picked[i - 1] == 1]
    assert [b - a for a, b in zip(bursts, bursts[1:], strict=False)][:2] == [4 + 1 + 10] * 2  # no back-off


def test_climbs_to_the_fastest_of_several_counts():
    chooser = ThreadChooser(8, period=20, burst=3)
    best = {1: 0.040, 2: 0.025, 4: 0.018, 8: 0.022}
    _run(chooser, lambda t, i: best[t], 400)
    assert chooser.choice == 4


def test_the_device_times_every_launch_under_eight_tokens_and_gives_larger_ones_all_threads(two_threads):

    from foveal.engine.device import SMALL_LAUNCH_TOKENS, CpuDevice
    from foveal.engine.trace import Trace

    device = CpuDevice(Trace())
    device.small_launch_threads = None  # timed (the suite fixes one thread: tests/conftest.py)
    device.chooser = ThreadChooser(2, period=1, burst=1)
    device.chooser.choice = 2
    assert all(device.threads_for(t) == 2 for t in range(1, SMALL_LAUNCH_TOKENS))  # the chooser's
    device.chooser.choice = 1
    assert all(device.threads_for(t) == 1 for t in range(1, SMALL_LAUNCH_TOKENS))
    assert device.threads_for(SMALL_LAUNCH_TOKENS) == 2
    device.small_launch_threads = 2  # fixed by a caller
    assert device.threads_for(1) == 2
    device.close()


def test_a_burst_job_gets_the_threads_of_one_of_its_forwards_and_is_timed_apart_from_them(two_threads):
    """A decode burst (engine/bursts.py) runs k forwards of B tokens in one job: its count is the one
    a forward of B tokens gets (not all threads, as k * B tokens would), and its time is kept under
    a key of its own, never compared with single forwards' (it is k of them)."""
    from foveal.engine.device import CpuDevice
    from foveal.engine.trace import Trace

    device = CpuDevice(Trace())
    device.small_launch_threads = None
    device.chooser = ThreadChooser(2, period=1000, burst=3)
    device.chooser.choice = 1
    seen = []
    device.chooser.observe = lambda shape, threads, seconds: seen.append((shape, threads))
    picked = []
    device.run("burst", lambda: picked.append(device.threads_for(2, 8)))
    device.run("forward", lambda: picked.append(device.threads_for(2)))
    device.synchronize()
    device.close()
    assert picked == [1, 1] and seen == [((2, 8), 1), (2, 1)]
