"""The exposure reading of a profiled decode replay (benchmarks/replay_timeline.py) on made-up kernels."""
import pytest

from benchmarks.replay_timeline import median_timeline, step_timeline

SIDE, MAIN = 7, 143


def step(lookup_len: float, gate_at: float, main_start: float = 0.0):
    """A replay: gathers of layers 1 and 15 on the side stream from t=0; on the main stream the embedding
    and layer 0 as 100 µs of kernels with 1 µs gaps from ``main_start``, then layer 1's gate at ``gate_at``."""
    side = [(0.0, lookup_len * 0.8, SIDE, "_gather_rows_kernel"),
            (lookup_len * 0.8 + 0.5, lookup_len, SIDE, "nvjet_wkv"),
            (lookup_len + 1, lookup_len + 50, SIDE, "_gather_rows_kernel")]
    main, t = [], main_start
    while t + 10 <= main_start + 100:
        main.append((t, t + 9.0, MAIN, "layer0_kernel"))
        t += 10
    main.append((gate_at, gate_at + 3, MAIN, "_engram_gate_kernel"))
    main.append((gate_at + 4, gate_at + 20, MAIN, "layer1_kernel"))
    return side + main


def test_a_lookup_hidden_behind_layer_0_is_not_exposed():
    t = step_timeline(step(lookup_len=60.0, gate_at=100.0))
    assert t.exposed_us == pytest.approx(0.0) and t.bound_us == 0.0
    assert t.lookup_us == pytest.approx(60.0) and t.before_us == pytest.approx(99.0)
    assert t.main_start_us == 0.0 and t.main_busy_us == pytest.approx(10 * 9 + 3 + 16)


def test_a_lookup_longer_than_layer_0_is_exposed_by_the_difference():
    t = step_timeline(step(lookup_len=150.0, gate_at=151.0))
    # the gate waits from layer 0's end (99) to 151; the usual gap between kernels is 1 µs
    assert t.exposed_us == pytest.approx(51.0)
    assert t.bound_us == pytest.approx(1.1 * (150.0 - 99.0))
    assert median_timeline([t, t])["exposed_us"] == pytest.approx(51.0)


def test_a_main_branch_that_waits_for_the_lookups_shows_in_main_start():
    t = step_timeline(step(lookup_len=150.0, gate_at=260.0, main_start=150.0))
    assert t.main_start_us == pytest.approx(150.0)


def test_a_step_without_gathers_or_consumers_is_an_error():
    with pytest.raises(ValueError, match="gather_rows"):
        step_timeline([(0.0, 1.0, MAIN, "layer0_kernel")])
    with pytest.raises(ValueError, match="engram_gate"):
        step_timeline([(0.0, 1.0, SIDE, "_gather_rows_kernel"), (0.0, 1.0, MAIN, "layer0_kernel")])


def test_clock_stamps_read_as_the_same_timeline():
    from benchmarks.replay_timeline import clock_timeline

    us = 1000  # stamps are ns
    stamps = {"fork": 5_000_000, "lookup_start": 5_000_000 + 2 * us, "main_start": 5_000_000 + 3 * us,
              "lookup_done_1": 5_000_000 + 150 * us, "wait_begin_1": 5_000_000 + 100 * us,
              "wait_end_1": 5_000_000 + 153 * us, "lookup_done_15": 5_000_000 + 240 * us,
              "wait_begin_15": 5_000_000 + 2000 * us, "wait_end_15": 5_000_000 + 2003 * us,
              "joined": 5_000_000 + 5000 * us}
    t = clock_timeline(stamps, [1, 15])
    assert t.lookup_us == 150 and t.before_us == 100 and t.main_start_us == 3 and t.span_us == 5000
    assert t.exposed_us == pytest.approx(50.0)  # 53 µs waited, less the 3 µs a pair of stamps takes
    assert t.bound_us == pytest.approx(55.0) and t.main_busy_us is None
    assert median_timeline([t])["main_busy_us"] is None
    del stamps["wait_end_15"]
    with pytest.raises(ValueError, match="wait_end_15"):
        clock_timeline(stamps, [1, 15])


def test_the_clock_stamps_named_points_in_order_on_the_cpu():
    from benchmarks.graph_clock import GraphClock

    clock = GraphClock("cpu", slots=3)
    for name in ("fork", "main_start", "fork"):
        clock.stamp(name)
    got = clock.read()
    assert list(got) == ["fork", "main_start"] and got["main_start"] <= got["fork"]  # fork stamped again last
    clock.snapshot()
    clock.stamp("main_start")
    clock.snapshot()
    first, second = clock.read_snapshots()
    assert first == got and second["main_start"] >= got["main_start"] and clock.read_snapshots() == []
    clock.stamp("joined")
    with pytest.raises(ValueError, match="slots"):
        clock.stamp("one_more")


def test_the_exposure_bound_is_read_to_the_clocks_resolution():
    from benchmarks.replay_timeline import STAMP_RESOLUTION_US, meets_exposure_bound
    assert meets_exposure_bound(1e-13, 0.0)  # float noise of a zero wait against a zero bound
    assert meets_exposure_bound(0.6, 0.0)
    assert not meets_exposure_bound(STAMP_RESOLUTION_US + 0.1, 0.0)
    assert meets_exposure_bound(100.5, 100.0)  # bound_us already carries the 1.1 x
    assert not meets_exposure_bound(102.0, 100.0)
