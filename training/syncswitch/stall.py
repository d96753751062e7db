"""What a stalled segment is, defined once for every watcher.

A segment is stalled when its global step has not moved for ``limit()`` seconds, in either protocol.
The limit scales with the job: ``max(floor, STEP_MULTIPLE x the typical time between two observed
step changes)``, so a slow but healthy model (minutes per step) is never killed, while a small one is
noticed after the floor. Before the first step, only the floor applies: it covers process start,
restore, the first trace, and a segment-end evaluation, so the floor is generous (the job's
``stall_seconds``, 600 s by default).

The launcher enforces it (it sees the chief's progress file every 0.2 s and fails the segment so
that a retry resumes from the last checkpoint); the segment trigger on the Airflow triggerer applies
the same rule to the chief's ``step`` events, with ``TRIGGER_GRACE_SECONDS`` on top so that it only
fires when the launcher itself is stuck.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

DEFAULT_STALL_SECONDS = 600.0
# A step change this many times slower than usual is a stall, whatever the floor says.
STEP_MULTIPLE = 20.0
# The trigger fires only this long after the launcher should have: the launcher fails a stalled
# segment with its logs; the trigger is the backstop for a launcher that hangs itself.
TRIGGER_GRACE_SECONDS = 60.0
_INTERVALS_KEPT = 32


class StallWatch:
    """Feed it every look at the progress counter; it says when the counter stopped moving."""

    def __init__(
        self,
        floor_seconds: float = DEFAULT_STALL_SECONDS,
        *,
        step_multiple: float = STEP_MULTIPLE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if floor_seconds <= 0:
            raise ValueError(f"stall_seconds: must be > 0, got {floor_seconds}")
        self.floor = floor_seconds
        self.step_multiple = step_multiple
        self._clock = clock
        self._step: float | None = None
        self._changed_at = clock()
        self._intervals: deque[float] = deque(maxlen=_INTERVALS_KEPT)

    @property
    def step(self) -> float | None:
        return self._step

    def observe(self, step: float | None) -> None:
        """The latest global step seen (None before the first step)."""
        if step is None or step == self._step:
            return
        now = self._clock()
        if self._step is not None:
            self._intervals.append(now - self._changed_at)
        self._step, self._changed_at = step, now

    def limit(self) -> float:
        if not self._intervals:
            return self.floor
        return max(self.floor, self.step_multiple * statistics.median(self._intervals))

    def idle_seconds(self) -> float:
        return self._clock() - self._changed_at

    def stalled(self, grace: float = 0.0) -> str | None:
        """Why the segment counts as stalled, or None while it progresses."""
        idle, limit = self.idle_seconds(), self.limit()
        if idle <= limit + grace:
            return None
        where = "before the first step" if self._step is None else f"at step {self._step:g}"
        return f"no new step for {idle:.0f} s ({where}; the limit is {limit:.0f} s)"
