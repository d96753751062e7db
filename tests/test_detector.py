"""The straggler detector on synthetic worker_step streams shaped like the trainer's.

BSP streams are in lockstep: every worker reports the same step_time (the all-reduce is a barrier);
a straggler shows only in its compute_time, the others wait for it. ASP streams: each worker closes
its own steps, so a straggler reports a longer step_time, and fewer of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from syncswitch_airflow.detector import DetectorConfig, StragglerDetector, Verdict

T0 = 1_700_000_000.0
TICK = 0.25  # the trainer averages worker_step events over ~0.25 s
BASE_COMPUTE = 0.10
ALLREDUCE = 0.02
CONFIG = DetectorConfig(window_seconds=5.0, threshold=1.5, raise_after=2, clear_after=3, lateness=1.0)

Slowdown = Callable[[int, float], float]  # (worker, seconds since T0) -> factor


def no_straggler(_worker: int, _t: float) -> float:
    return 1.0


def straggler(worker: int, start: float, end: float, factor: float) -> Slowdown:
    def slowdown(w: int, t: float) -> float:
        return factor if w == worker and start <= t < end else 1.0

    return slowdown


def bsp_stream(workers: int, seconds: float, slowdown: Slowdown, seed: int = 0) -> list[dict]:
    """Lockstep events: equal step_time for all workers, per-worker compute_time."""
    rng = random.Random(seed)
    events = []
    t, step = 0.0, 0.0
    while t < seconds:
        computes = [BASE_COMPUTE * slowdown(w, t) * rng.uniform(0.9, 1.1) for w in range(workers)]
        step_time = max(computes) + ALLREDUCE
        step += TICK / step_time
        for w, compute in enumerate(computes):
            events.append(
                {
                    "event": "worker_step",
                    "worker": w,
                    "wall_time": T0 + t + 0.001 * w,
                    "global_step": step,
                    "step_time": step_time,
                    "compute_time": compute,
                    "wait_time": step_time - compute,
                }
            )
        t += TICK
    return events


def asp_stream(workers: int, seconds: float, slowdown: Slowdown, seed: int = 0) -> list[dict]:
    """Each worker at its own pace: a slow worker reports longer steps, less often."""
    rng = random.Random(seed)
    events = []
    for w in range(workers):
        t = 0.0
        while t < seconds:
            step_time = 0.18 * slowdown(w, t) * rng.uniform(0.9, 1.1)
            t += step_time
            events.append(
                {
                    "event": "worker_step",
                    "worker": w,
                    "wall_time": T0 + t,
                    "global_step": 0.0,
                    "step_time": step_time,
                    "compute_time": 0.065,
                    "wait_time": step_time - 0.065,
                }
            )
    events.sort(key=lambda e: e["wall_time"])
    return events


def run(
    events: list[dict], protocol: str = "bsp", config: DetectorConfig = CONFIG, **kwargs
) -> list[Verdict]:
    return StragglerDetector(config, protocol=protocol, **kwargs).feed(events)


def changes(verdicts: list[Verdict]) -> list[tuple[str, float]]:
    return [(v.change, v.window_end - T0) for v in verdicts if v.change]


@pytest.mark.parametrize("workers", [2, 4])
def test_clean_stream_gives_no_verdict(workers: int) -> None:
    verdicts = run(bsp_stream(workers, 60, no_straggler))
    assert len(verdicts) >= 10
    assert not any(v.straggling for v in verdicts)
    assert changes(verdicts) == []
    assert all(v.evidence for v in verdicts)
    assert all(set(v.stats) == set(range(workers)) for v in verdicts)


@pytest.mark.parametrize("workers", [2, 4])
def test_step_change_is_raised_within_k_windows_and_names_the_worker(workers: int) -> None:
    slow = workers - 1
    verdicts = run(bsp_stream(workers, 60, straggler(slow, 20.0, 999.0, 2.5)))
    raised = [v for v in verdicts if v.change == "raised"]
    assert len(raised) == 1
    verdict = raised[0]
    assert verdict.workers == [slow]
    assert 2.0 <= verdict.slowdown <= 3.0
    # Onset: the window starting within one window of t=20 (windows are aligned on the first
    # counted sample, at 0.25 s); raised after K=2 flagged windows.
    assert verdict.since is not None and abs(verdict.since - T0 - 20.0) <= CONFIG.window_seconds
    assert verdict.window_end - verdict.since <= CONFIG.raise_after * CONFIG.window_seconds + 1e-9
    assert verdict.window_end - T0 <= 20.0 + (CONFIG.raise_after + 1) * CONFIG.window_seconds
    # Everything before the onset was clean; everything after stays raised (no flapping).
    assert not any(v.straggling for v in verdicts if v.window_end <= verdict.since)
    assert all(v.straggling for v in verdicts if v.window_end >= verdict.window_end)
    # The numbers a policy needs: healthy baseline, extra compute per step, measured step time.
    assert verdict.baseline == pytest.approx(BASE_COMPUTE, rel=0.15)
    assert verdict.extra_time == pytest.approx(1.5 * BASE_COMPUTE, rel=0.2)
    assert verdict.step_time == pytest.approx(2.5 * BASE_COMPUTE + ALLREDUCE, rel=0.15)


def test_bsp_lockstep_with_equal_step_times_still_names_the_slow_worker() -> None:
    events = bsp_stream(2, 40, straggler(0, 0.0, 999.0, 2.0))
    by_tick: dict[float, set[float]] = {}
    for e in events:
        by_tick.setdefault(round(e["wall_time"] - T0, 1), set()).add(e["step_time"])
    assert len(by_tick) > 100 and all(len(times) == 1 for times in by_tick.values())  # lockstep

    verdicts = run(events, protocol="bsp")
    assert verdicts[-1].signal == "compute_time"
    assert verdicts[-1].straggling and verdicts[-1].workers == [0]
    # The healthy worker waits on the all-reduce for the straggler's extra compute.
    last = verdicts[-1].stats
    assert last[0].factor is not None and last[0].factor >= 1.5
    assert last[1].factor is not None and last[1].factor < 1.0

    # step_time cannot tell the workers apart in BSP: that is why BSP uses compute_time.
    blind = run(events, protocol="bsp", config=DetectorConfig(**{**CONFIG.to_dict(), "signal": "step_time"}))
    assert not any(v.straggling for v in blind)


def test_bsp_names_the_worker_behind_a_slow_link_by_its_round_trip_to_its_peers() -> None:
    """A delayed link leaves every worker's compute time alone (all wait in the all-reduce alike);
    the slow worker's smallest round trip to a peer is what rises (syncswitch.peers)."""
    events = bsp_stream(3, 60, no_straggler)
    for e in events:
        slow_link = e["worker"] == 2 and 10.0 <= e["wall_time"] - T0 < 30.0
        e["peer_rtt"] = 0.030 if slow_link else 0.0002

    verdicts = run(events, protocol="bsp")
    assert [c for c, _ in changes(verdicts)] == ["raised", "cleared"]
    raised = next(v for v in verdicts if v.change == "raised")
    assert raised.workers == [2] and raised.slowdown >= 1.5 and 10.0 <= raised.since - T0 <= 15.0
    # Without the round trips the same run shows nothing: compute time cannot see a slow link.
    for e in events:
        e.pop("peer_rtt")
    assert not any(v.straggling for v in run(events, protocol="bsp"))


def test_a_single_spike_does_not_flap() -> None:
    # Counted samples start at 0.25 s (the first is skipped as warm-up): window 2 is [10.25, 15.25).
    spike = straggler(1, 10.25, 15.25, 3.0)
    verdicts = run(bsp_stream(2, 60, spike))
    flagged = [v for v in verdicts if (v.stats[1].factor or 0) >= CONFIG.threshold]
    assert len(flagged) == 1  # the spike did reach the detector, in one window
    assert not any(v.straggling for v in verdicts)
    assert changes(verdicts) == []


def test_bsp_names_a_duty_cycled_straggler_whose_stops_hit_a_minority_of_its_steps() -> None:
    """A worker stopped 150 ms of every 200 ms (CPU quota throttling, the injector's SIGSTOP cycles)
    whose steps compute for 3.5 ms, far less than a cycle: most of its ~0.25 s averages hold no stop
    inside its compute (the stops fall in the all-reduce or between steps), one in four holds a whole
    one. The median of those averages reads it healthy; the window's mean names it."""
    compute, events = 0.0035, []
    for tick in range(160):  # 40 s
        for worker in (0, 1):
            stopped = worker == 1 and tick % 4 == 0
            own = compute + (0.150 / 4 if stopped else 0.0)  # one stop shared by the tick's ~4 steps
            events.append(
                {
                    "event": "worker_step",
                    "worker": worker,
                    "wall_time": T0 + tick * TICK + 0.001 * worker,
                    "global_step": tick * 4.0,
                    "step_time": 0.06,
                    "compute_time": own,
                    "wait_time": 0.06 - own,
                }
            )
    computes = sorted(e["compute_time"] for e in events if e["worker"] == 1)
    assert computes[len(computes) // 2] == compute  # what a median reads: healthy
    raised = [v for v in run(events) if v.change == "raised"]
    assert raised and raised[0].workers == [1] and raised[0].slowdown >= 3.0


def test_clears_only_after_m_clean_windows() -> None:
    verdicts = run(bsp_stream(2, 90, straggler(1, 20.0, 50.0, 2.5)))
    assert [c for c, _ in changes(verdicts)] == ["raised", "cleared"]
    cleared_at = next(i for i, v in enumerate(verdicts) if v.change == "cleared")
    clean_before = verdicts[cleared_at - CONFIG.clear_after + 1 : cleared_at + 1]
    assert all((v.stats[1].factor or 0) < CONFIG.threshold for v in clean_before)
    assert (verdicts[cleared_at - CONFIG.clear_after].stats[1].factor or 0) >= CONFIG.threshold
    # Still raised during the first M-1 clean windows (hysteresis), and the onset is kept on clearing.
    assert all(v.straggling for v in clean_before[:-1])
    cleared = verdicts[cleared_at]
    assert not cleared.straggling and cleared.since is not None and abs(cleared.since - T0 - 20.0) <= 5.0
    assert cleared.window_end - T0 >= 50.0 + (CONFIG.clear_after - 1) * CONFIG.window_seconds
    assert verdicts[-1].since is None  # a later clean window carries no episode


def test_whole_cluster_slowdown_is_not_a_straggler() -> None:
    def everyone_slower(_w: int, t: float) -> float:
        return 3.0 if t >= 20.0 else 1.0

    verdicts = run(bsp_stream(4, 60, everyone_slower))
    assert not any(v.straggling for v in verdicts)


@pytest.mark.parametrize("workers", [2, 4])
def test_asp_uses_step_time_and_names_the_slow_worker(workers: int) -> None:
    verdicts = run(asp_stream(workers, 60, straggler(0, 20.0, 999.0, 2.0)), protocol="asp")
    raised = [v for v in verdicts if v.change == "raised"]
    assert len(raised) == 1 and raised[0].workers == [0]
    assert raised[0].signal == "step_time"
    assert raised[0].slowdown == pytest.approx(2.0, rel=0.25)
    assert not any(v.straggling for v in verdicts if v.window_end - T0 <= 20.0)


def test_asp_worker_that_stops_reporting_is_flagged_by_its_open_step() -> None:
    events = [
        e for e in asp_stream(2, 60, no_straggler) if not (e["worker"] == 1 and e["wall_time"] - T0 > 20)
    ]
    verdicts = run(events, protocol="asp")
    late = [v for v in verdicts if v.window_end - T0 > 35]
    assert late and all(v.straggling and v.workers == [1] for v in late)
    assert all(v.stats[1].open_step for v in late)


def test_incremental_feeding_gives_the_same_verdicts_as_one_batch() -> None:
    events = bsp_stream(3, 60, straggler(2, 20.0, 40.0, 2.0))
    whole = run(events)
    detector = StragglerDetector(CONFIG, protocol="bsp")
    pieces: list[Verdict] = []
    for start in range(0, len(events), 7):
        pieces.extend(detector.feed(events[start : start + 7]))
    assert pieces == whole


def test_events_inside_the_lateness_allowance_still_count_and_later_ones_are_dropped() -> None:
    events = bsp_stream(2, 30, no_straggler)
    late_event = dict(events[10], wall_time=T0 + 1.0)  # window 0, arriving after 10 s of events
    detector = StragglerDetector(CONFIG, protocol="bsp")
    detector.feed(events[:30])
    detector.feed([dict(events[5], wall_time=T0 + 4.0)])  # window 0 is still open (lateness)
    assert detector.dropped_late == 0
    detector.feed(events[30:])
    detector.feed([late_event])
    assert detector.dropped_late == 1


def test_starting_straggling_reports_cleared_after_m_clean_windows() -> None:
    verdicts = run(
        asp_stream(2, 40, no_straggler), protocol="asp", straggling_since=T0 - 30, straggling_workers=[1]
    )
    assert verdicts[0].straggling and verdicts[0].workers == [1]
    cleared = [i for i, v in enumerate(verdicts) if v.change == "cleared"]
    assert cleared == [CONFIG.clear_after - 1]
    assert verdicts[cleared[0]].since == T0 - 30


def test_ignores_other_event_types_and_warm_up_samples() -> None:
    events = bsp_stream(2, 30, no_straggler)
    # A slow first step (graph tracing) on worker 1 is skipped; other event types are ignored.
    events[1] = dict(events[1], compute_time=5.0)
    noise = [{"event": "step", "wall_time": T0 + 1, "global_step": 3, "step_time": 9.0}]
    verdicts = run(noise + events)
    assert not any(v.straggling for v in verdicts)
    assert verdicts[0].stats[1].mean == pytest.approx(BASE_COMPUTE, rel=0.15)


def test_one_worker_gives_no_evidence() -> None:
    verdicts = run(bsp_stream(1, 30, no_straggler))
    assert verdicts and not any(v.evidence or v.straggling for v in verdicts)


def test_verdict_round_trips_through_json() -> None:
    verdict = run(bsp_stream(2, 40, straggler(1, 5.0, 999.0, 2.0)))[-1]
    assert Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))) == verdict


@pytest.mark.parametrize(
    "bad",
    [{"window_seconds": 0}, {"threshold": 1.0}, {"raise_after": 0}, {"lateness": -1}, {"signal": "loss"}],
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        DetectorConfig(**bad)


def test_the_signal_follows_the_protocols_topology() -> None:
    """All-reduce protocols wait in lockstep (their own share singles a straggler out); the
    parameter-server ones close their own steps."""
    signals = {
        p: StragglerDetector(CONFIG, protocol=p).signal for p in ("bsp", "cbsp", "local", "asp", "ssp")
    }
    assert signals == {
        "bsp": "compute_time",
        "cbsp": "compute_time",
        "local": "compute_time",
        "asp": "step_time",
        "ssp": "step_time",
    }
    with pytest.raises(ValueError, match="protocol"):
        StragglerDetector(CONFIG, protocol="sync")
