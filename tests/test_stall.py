"""The one stall rule (syncswitch.stall), on a fake clock."""

from __future__ import annotations

import pytest
from syncswitch.stall import StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_before_the_first_step_only_the_floor_applies() -> None:
    clock = Clock()
    watch = StallWatch(30.0, clock=clock)
    watch.observe(None)
    clock.now = 30.0
    assert watch.stalled() is None
    clock.now = 30.5
    assert "before the first step" in watch.stalled()


def test_a_slow_healthy_job_gets_a_limit_that_scales_with_its_step_time() -> None:
    clock = Clock()
    watch = StallWatch(30.0, step_multiple=20, clock=clock)
    for step in range(1, 6):  # one step every 10 s: 20 x 10 s = 200 s > the 30 s floor
        clock.now = 10.0 * step
        watch.observe(float(step))
    assert watch.limit() == pytest.approx(200.0)
    clock.now += 199.0
    assert watch.stalled() is None
    clock.now += 2.0
    assert "at step 5" in watch.stalled()


def test_a_fast_job_is_held_to_the_floor_and_grace_extends_it() -> None:
    clock = Clock()
    watch = StallWatch(30.0, clock=clock)
    for step in range(1, 50):
        clock.now = 0.1 * step
        watch.observe(float(step))
    assert watch.limit() == 30.0
    clock.now += 31.0
    assert watch.stalled() is not None
    assert watch.stalled(grace=60.0) is None


def test_an_unchanged_step_is_no_progress() -> None:
    clock = Clock()
    watch = StallWatch(10.0, clock=clock)
    watch.observe(3.0)
    for t in range(1, 12):
        clock.now = float(t)
        watch.observe(3.0)
    assert watch.stalled() is not None


def test_the_floor_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_seconds"):
        StallWatch(0.0)
