"""BspLoop's bookkeeping: one step per call while the graph warms up, then calls sized on the
all-reduced step time (capped by a call's wall time), never across a checkpoint boundary or the
target, and every worker's stop vote. The all-reduced totals stand in for the graph's here; the real
thing runs in test_runtime_cluster.py."""

from __future__ import annotations

import numpy as np
from segment_specs import segment_spec
from syncswitch.bsp import MAX_CALL_SECONDS, BspLoop
from syncswitch.hparams import HParams
from syncswitch.trainer import MAX_STEPS_PER_EXECUTION, TARGET_EXECUTION_SECONDS, WARMUP_EXECUTIONS

WORKERS = 2


def loop(
    until_step: int, ckpt_frequency: int, *, start_step: int = 0, steps_per_execution: int = 0
) -> BspLoop:
    spec = segment_spec("bsp", WORKERS, until_step, ckpt_frequency)
    hp = HParams(model="cnn", batch_size=32, steps_per_execution=steps_per_execution)
    return BspLoop(spec, hp, samples=start_step * WORKERS * 32, updates=start_step)


def totals(count: int, *, step_seconds: float, wall_per_step: float, stop: bool = False) -> np.ndarray:
    """What the graph all-reduces: per-step losses, the stop votes, every worker's step seconds summed,
    every worker's wall seconds per step of the previous call summed."""
    return np.array(
        [0.5] * count + [1.0 if stop else 0.0, step_seconds * count * WORKERS, wall_per_step * WORKERS],
        np.float32,
    )


def drive(bsp: BspLoop, step_seconds: float, wall_per_step: float) -> tuple[list[int], list[int]]:
    """Run the loop like run_bsp_worker does; returns each call's size and the steps checkpointed at."""
    counts, saved_at = [], []
    while not bsp.finished:
        count = bsp.next_count()
        counts.append(count)
        bsp.advance(count, totals(count, step_seconds=step_seconds, wall_per_step=wall_per_step), 0.0)
        if bsp.checkpoint_due:
            saved_at.append(bsp.step)
    return counts, saved_at


def test_calls_warm_up_then_grow_but_never_cross_a_checkpoint_or_the_target() -> None:
    bsp = loop(until_step=250, ckpt_frequency=100)
    counts, saved_at = drive(bsp, step_seconds=0.001, wall_per_step=0.001)
    assert counts[: WARMUP_EXECUTIONS + 1] == [1] * (WARMUP_EXECUTIONS + 1)
    assert max(counts) == MAX_STEPS_PER_EXECUTION
    assert sum(counts) == 250 and bsp.step == 250 and bsp.updates == 250
    assert saved_at == [100, 200]  # not 250: the segment's end is saved by the caller
    steps = np.cumsum(counts)
    assert 100 in steps and 200 in steps  # each call ended on the boundary


def test_a_segment_that_starts_mid_interval_checkpoints_on_the_global_boundaries() -> None:
    bsp = loop(until_step=330, ckpt_frequency=100, start_step=130)
    _counts, saved_at = drive(bsp, step_seconds=0.001, wall_per_step=0.001)
    assert saved_at == [200, 300] and bsp.step == 330


def test_the_call_size_follows_the_step_time_and_the_wall_time_caps_it() -> None:
    # In-graph 10 ms a step: 25 steps make the target execution time.
    counts, _ = drive(loop(until_step=200, ckpt_frequency=0), step_seconds=0.01, wall_per_step=0.01)
    assert counts[-2] == round(TARGET_EXECUTION_SECONDS / 0.01)
    # A slow link: 0.25 s of wall time a step caps a call at MAX_CALL_SECONDS.
    counts, _ = drive(loop(until_step=200, ckpt_frequency=0), step_seconds=0.01, wall_per_step=0.25)
    assert counts[-2] == int(MAX_CALL_SECONDS / 0.25)
    # A fixed hparam wins over both.
    counts, _ = drive(loop(until_step=50, ckpt_frequency=0, steps_per_execution=7), 0.01, 0.2)
    assert counts[WARMUP_EXECUTIONS + 1] == 7


def test_the_step_time_is_reported_once_when_first_measured() -> None:
    bsp = loop(until_step=100, ckpt_frequency=0)
    firsts = []
    while not bsp.finished:
        count = bsp.next_count()
        _stop, measured = bsp.advance(count, totals(count, step_seconds=0.004, wall_per_step=0.005), 0.0)
        firsts.append(measured)
    measured = [m for m in firsts if m is not None]
    assert len(measured) == 1 and abs(measured[0] - 0.004) < 1e-6
    assert firsts.index(measured[0]) == 2  # the first call traces, the second reports its wall time


def test_any_workers_stop_vote_stops_every_worker() -> None:
    bsp = loop(until_step=100, ckpt_frequency=0)
    stop, _ = bsp.advance(1, totals(1, step_seconds=0.01, wall_per_step=0.01, stop=True), 0.01)
    assert stop and not bsp.finished and bsp.step == 1
