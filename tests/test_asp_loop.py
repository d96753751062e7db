"""AspLoop's bookkeeping: exact targets, drained checkpoints, early stops on whole BSP steps.

The loop only calls ``fetch()`` on what ClusterCoordinator.schedule returns, so a finished value
stands in for TF's RemoteValue here; the real thing runs in test_runtime_cluster.py.
"""

from __future__ import annotations

import random

import pytest
from syncswitch.spec import SegmentSpec
from syncswitch.trainer import AspLoop


class FinishedValue:
    def fetch(self) -> tuple[float, int, float, float]:
        return 0.1, 0, 0.01, 0.02


def drive(loop: AspLoop, stop_after: int | None) -> list[int]:
    """Run the loop like run_asp_chief does; returns the closure counts at each checkpoint."""
    saved_at = []
    while True:
        if stop_after is not None and loop.done >= stop_after:
            loop.request_stop()
        if loop.finished:
            return saved_at
        while loop.may_schedule():
            loop.add(FinishedValue(), 0.1, 0.9)
        loop.collect()
        if loop.at_checkpoint_boundary():
            saved_at.append(loop.done)


def spec(workers: int, until_step: int, ckpt_frequency: int) -> SegmentSpec:
    return SegmentSpec(
        run_id="r",
        run_dir="/tmp/unused",
        index=0,
        protocol="asp",
        until_step=until_step,
        total_steps=until_step,
        model="cnn",
        hparam_set="cnn_digits",
        problem="digits",
        num_workers=workers,
        ckpt_frequency=ckpt_frequency,
    )


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_reaches_the_target_exactly_with_drained_checkpoints(workers: int) -> None:
    loop = AspLoop(spec(workers, 120, 50), 32, 32 * workers, 0)
    saved_at = drive(loop, stop_after=None)
    assert loop.done == loop.scheduled == 120 * workers
    assert saved_at == [50 * workers, 100 * workers]


def test_resumes_mid_job_from_a_step_boundary() -> None:
    loop = AspLoop(spec(2, 120, 50), 32, 64, start_samples=40 * 64)
    drive(loop, stop_after=None)
    assert loop.done_samples == 120 * 64


def test_early_stops_land_on_whole_steps_randomised() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        workers = rng.choice([1, 2, 3, 4])
        loop = AspLoop(spec(workers, 300, rng.choice([0, 7, 50])), 32, 32 * workers, 0)
        drive(loop, stop_after=rng.randint(0, 700))
        assert loop.done == loop.scheduled
        assert loop.done % workers == 0, "an early stop must end on a whole BSP-equivalent step"
        assert loop.done <= 300 * workers


def test_stop_exactly_at_a_drained_checkpoint_ends_there() -> None:
    # The case that once collected from an empty queue: the stop arrives with nothing in flight.
    loop = AspLoop(spec(2, 300, 50), 32, 64, 0)
    drive(loop, stop_after=100)
    assert loop.done == 100


class LostValue:
    """A closure that died with its worker, as ClusterCoordinator reports it."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def fetch(self) -> tuple[float, int, float, float]:
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


def test_closures_lost_with_a_worker_are_rescheduled_and_the_target_stays_exact() -> None:
    loop = AspLoop(spec(2, 120, 50), 32, 64, 0)
    pending_losses = lost_worker_errors() * 3
    saved_at = []
    while not loop.finished:
        while loop.may_schedule():
            value = LostValue(pending_losses.pop()) if pending_losses else FinishedValue()
            loop.add(value, 0.1, 0.9)
        if loop.collect() is not None and loop.at_checkpoint_boundary():
            saved_at.append(loop.done)
    assert loop.lost == 6
    assert loop.done == loop.scheduled == 120 * 2
    assert saved_at == [100, 200]


def test_a_broken_step_is_not_mistaken_for_a_lost_worker() -> None:
    import tensorflow as tf

    from_ps = tf.errors.UnavailableError(None, None, "GRPC error information from remote target /job:ps")
    for error in (tf.errors.InvalidArgumentError(None, None, "/job:worker/task:0: bad shape"), from_ps):
        loop = AspLoop(spec(2, 10, 0), 32, 64, 0)
        loop.add(LostValue(error), 0.1, 0.9)
        with pytest.raises(type(error)):
            loop.collect()
