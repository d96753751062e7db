"""AspLoop's bookkeeping: exact targets, drained checkpoints, early stops on whole BSP steps, closures
of several updates sized to the boundaries, lost closures rescheduled with their own updates, and
SSP's closures cut short at the staleness bound (the rest scheduled again, held while nothing moved),
and an output whose copy failed in transit fetched again rather than its closure run again.

The loop only calls ``fetch()`` on what ClusterCoordinator.schedule returns, so a finished value
stands in for TF's RemoteValue here; the real thing runs in test_runtime_cluster.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from segment_specs import segment_spec
from syncswitch.asp import AspLoop, Closure
from syncswitch.spec import SegmentSpec


class FinishedValue:
    """A closure's packed output: worker 0, the steps it ran (all, or ``ran``), then one record per
    step (trainer.RECORD_COLUMNS)."""

    def __init__(self, closure: Closure, ran: int | None = None) -> None:
        self.closure = closure
        self.ran = closure.count if ran is None else ran

    def fetch(self) -> np.ndarray:
        return np.array([0.0, self.ran] + [0.1, 0.01, 0.02, 1000.0, 0.0] * self.ran, np.float32)


def drive(loop: AspLoop, stop_after: int | None, size: int = 1, sizes: list[int] | None = None) -> list[int]:
    """Run the loop like run_asp_chief does; returns the update counts at each checkpoint."""
    saved_at = []
    while True:
        if stop_after is not None and loop.done >= stop_after:
            loop.request_stop()
        if loop.finished:
            return saved_at
        while (closure := loop.next_closure(size)) is not None:
            if sizes is not None:
                sizes.append(closure.count)
            loop.add(FinishedValue(closure), closure)
        loop.collect()
        if loop.at_checkpoint_boundary():
            saved_at.append(loop.done)


def spec(workers: int, until_step: int, ckpt_frequency: int) -> SegmentSpec:
    return segment_spec("asp", workers, until_step, ckpt_frequency)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 7, 64])
def test_reaches_the_target_exactly_with_drained_checkpoints(workers: int, size: int) -> None:
    loop = AspLoop(spec(workers, 120, 50), 32, 32 * workers, 0)
    sizes: list[int] = []
    saved_at = drive(loop, stop_after=None, size=size, sizes=sizes)
    assert loop.done == loop.scheduled == 120 * workers
    assert saved_at == [50 * workers, 100 * workers]
    assert max(sizes) <= size and sum(sizes) == 120 * workers


def test_the_last_closure_before_a_boundary_is_sized_to_it() -> None:
    # 2 workers, a checkpoint every 5 steps = 10 updates, closures of 4: 4 + 4 + 2, then again.
    loop = AspLoop(spec(2, 10, 5), 32, 64, 0)
    sizes: list[int] = []
    saved_at = drive(loop, stop_after=None, size=4, sizes=sizes)
    assert sizes == [4, 4, 2, 4, 4, 2]
    assert saved_at == [10]


def test_resumes_mid_job_from_a_step_boundary() -> None:
    loop = AspLoop(spec(2, 120, 50), 32, 64, start_samples=40 * 64)
    saved_at = drive(loop, stop_after=None, size=16)
    assert loop.done_samples == 120 * 64
    assert saved_at == [(50 - 40) * 2, (100 - 40) * 2]  # on the job's absolute step boundaries


def test_early_stops_land_on_whole_steps_randomised() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        workers = rng.choice([1, 2, 3, 4])
        loop = AspLoop(spec(workers, 300, rng.choice([0, 7, 50])), 32, 32 * workers, 0)
        size = rng.choice([1, 3, 16])
        drive(loop, stop_after=rng.randint(0, 700), size=size)
        assert loop.done == loop.scheduled
        assert loop.done % workers == 0, "an early stop must end on a whole BSP-equivalent step"
        assert loop.done <= 300 * workers


def test_a_graceful_stop_lands_within_one_closure_per_worker() -> None:
    # What is in flight when the stop arrives still runs; nothing more than a whole step after it.
    loop = AspLoop(spec(2, 1000, 0), 32, 64, 0)
    drive(loop, stop_after=100, size=8)
    assert 100 <= loop.done <= 100 + loop.window * 8


def test_stop_exactly_at_a_drained_checkpoint_ends_there() -> None:
    # The case that once collected from an empty queue: the stop arrives with nothing in flight.
    loop = AspLoop(spec(2, 300, 50), 32, 64, 0)
    drive(loop, stop_after=100)
    assert loop.done == 100


class LostValue:
    """A closure that died with its worker, as ClusterCoordinator reports it."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def fetch(self) -> np.ndarray:
        raise self.error


def lost_worker_errors() -> list[Exception]:
    import tensorflow as tf

    return [
        tf.errors.UnknownError(
            None,
            None,
            "Failed to get error information from remote target /job:worker/replica:0/task:1 while "
            "calling /tensorflow.eager.EagerService/Enqueue: Connection reset by peer",
        ),
        tf.errors.CancelledError(None, None, "The corresponding function is cancelled."),
    ]


def test_closures_lost_with_a_worker_are_rescheduled_with_their_own_updates() -> None:
    loop = AspLoop(spec(2, 120, 50), 32, 64, 0)
    pending_losses = lost_worker_errors() * 3
    lost_ranges, rescheduled = [], []
    saved_at = []
    while not loop.finished:
        while (closure := loop.next_closure(6)) is not None:
            if closure in lost_ranges:
                rescheduled.append(closure)
            if pending_losses:
                lost_ranges.append(closure)
                loop.add(LostValue(pending_losses.pop()), closure)
            else:
                loop.add(FinishedValue(closure), closure)
        if loop.collect() is not None and loop.at_checkpoint_boundary():
            saved_at.append(loop.done)
    assert loop.lost == 6
    # The same updates (hence the same LR schedule positions) run again, and the target stays exact.
    assert sorted(rescheduled, key=lambda c: c.first) == sorted(lost_ranges, key=lambda c: c.first)
    assert loop.done == loop.scheduled == 120 * 2
    assert saved_at == [100, 200]


def test_a_broken_step_is_not_mistaken_for_a_lost_worker() -> None:
    import tensorflow as tf

    from_ps = tf.errors.UnavailableError(None, None, "GRPC error information from remote target /job:ps")
    for error in (tf.errors.InvalidArgumentError(None, None, "/job:worker/task:0: bad shape"), from_ps):
        loop = AspLoop(spec(2, 10, 0), 32, 64, 0)
        loop.add(LostValue(error), Closure(0, 1))
        with pytest.raises(type(error)):
            loop.collect()


class CopyFailsOnce(FinishedValue):
    """A closure that ran, whose output's copy back to the coordinator failed once in transit (as
    in a CI run: the worker's gRPC server could not parse the copy's request)."""

    def __init__(self, closure: Closure) -> None:
        super().__init__(closure)
        self.fetches = 0

    def fetch(self) -> np.ndarray:
        import tensorflow as tf

        self.fetches += 1
        if self.fetches == 1:
            raise tf.errors.InternalError(
                None,
                None,
                "2 root error(s) found.\n (0) INTERNAL: Unable to parse request\nAdditional GRPC error "
                "information from remote target /job:worker/replica:0/task:1/device:CPU:0 while calling "
                "/tensorflow.eager.EagerService/RunComponentFunction",
            )
        return super().fetch()


def test_an_output_whose_copy_failed_in_transit_is_fetched_again_not_run_again() -> None:
    loop = AspLoop(spec(2, 10, 0), 32, 64, 0)
    closure = loop.next_closure(4)
    value = CopyFailsOnce(closure)
    loop.add(value, closure)
    _worker, records, cut = loop.collect()
    assert value.fetches == 2
    assert records.shape == (4, 5) and not cut
    assert loop.done == 4 and loop.lost == 0
    assert loop.next_closure(4) == Closure(4, 4), "its updates are not handed out again"


def test_an_ssp_closure_cut_at_the_bound_hands_back_the_rest_of_its_updates() -> None:
    loop = AspLoop(spec(2, 60, 0), 32, 64, 0)
    closure = loop.next_closure(8)
    loop.add(FinishedValue(closure, 3), closure)
    _worker, records, cut = loop.collect()
    assert cut and records.shape == (3, 5)
    assert loop.next_closure(8) == Closure(3, 5), "the rest keeps its update numbers (the LR schedule's)"
    assert loop.done == 3


def test_a_closure_that_ran_no_step_waits_until_a_clock_moved() -> None:
    """Its worker was at the bound: handed out again at once, it would most likely come back empty
    again. It goes out after another closure has run a step, or once nothing else is in flight."""
    loop = AspLoop(spec(2, 60, 0), 32, 64, 0)
    blocked, running = loop.next_closure(8), loop.next_closure(8)
    loop.add(FinishedValue(blocked, 0), blocked)
    loop.add(FinishedValue(running), running)
    _worker, records, cut = loop.collect()
    assert cut and not len(records)
    assert loop.next_closure(8) == Closure(16, 8), "held while the other closure may still move a clock"
    loop.collect()  # the running one: 8 steps
    assert loop.next_closure(8) == blocked

    alone = AspLoop(spec(2, 60, 0), 32, 64, 0)
    closure = alone.next_closure(8)
    alone.add(FinishedValue(closure, 0), closure)
    alone.collect()
    assert alone.next_closure(8) == closure, "nothing in flight can move a clock: out again at once"
