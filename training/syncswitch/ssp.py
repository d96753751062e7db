"""Stale-synchronous parallel (SSP) on ParameterServerStrategy: per-worker clocks and their bound.

A worker's clock is the number of steps it has finished in the segment: one int64 entry per worker,
in a variable on a parameter server. A worker whose clock is k may start step k+1 only while
k - min(clocks) <= s, so no worker starts step c+s+1 before every worker has finished step c (Ho et
al., 2013): s=0 is lockstep, and an s no run reaches is ASP. Updates themselves are ASP's (each
worker's applied on the parameter servers as it comes), as is the configuration policy.

The bound is checked inside the closure, not by the coordinator: ClusterCoordinator gives a closure
to whichever worker is free, so it cannot hold one worker back. After each update a worker advances
its clock (ordered after the update's ops), then reads every clock: that read is the lead its next
step is checked against and records (the ``clock_lead`` of syncswitch.trainer's records). Other
clocks only grow, so the check can only be stricter than the bound at the moment the step starts.
A closure whose worker may not go on ends early with the steps it ran; the coordinator schedules
the rest again once another closure has moved a clock (syncswitch.asp.AspLoop).

Worker loss fails an SSP segment (syncswitch.protocols): a lost worker's clock stops, and every other
worker would stop within s steps of it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class ClockGate:
    """The clocks of one SSP segment and the in-graph rule. Build it under the strategy's scope,
    before the first closure is scheduled (ParameterServerStrategy's rule for every variable)."""

    def __init__(self, num_workers: int, staleness: int) -> None:
        self.staleness = staleness
        self.clocks = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False, name="ssp_clocks")

    @staticmethod
    def _worker() -> Any:
        return tf.distribute.coordinator.experimental_get_current_worker_index()

    def _lead(self) -> Any:
        """This worker's clock minus the slowest worker's, as float32 (one read of every clock)."""
        clocks = self.clocks.read_value()
        return tf.cast(tf.gather(clocks, self._worker()) - tf.reduce_min(clocks), tf.float32)

    def first_lead(self) -> Any:
        """The lead the closure's first step is checked against."""
        return self._lead()

    def allows(self, lead: Any) -> Any:
        return lead <= float(self.staleness)

    def after_update(self, updates: list[Any]) -> Any:
        """Advance this worker's clock once the update is applied; returns the lead the next step is
        checked against."""
        with tf.control_dependencies(updates):
            tick = self.clocks.scatter_add(
                tf.IndexedSlices(tf.ones([1], tf.int64), tf.reshape(tf.cast(self._worker(), tf.int64), [1]))
            )
        with tf.control_dependencies([tick]):
            return self._lead()


class LeadTally:
    """The coordinator's account of an SSP segment: the leads its steps started with, and how many
    closures ended early at the bound."""

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness
        self.counts: dict[int, int] = {}
        self.cut_closures = 0

    def add(self, leads: Any, cut: bool) -> None:
        for lead in leads:
            self.counts[int(lead)] = self.counts.get(int(lead), 0) + 1
        self.cut_closures += int(cut)

    def summary(self) -> dict[str, Any]:
        """For the segment's result: the bound, the largest lead a step started with, the steps per
        lead, the closures the bound cut short."""
        return {
            "bound": self.staleness,
            "max_lead": max(self.counts, default=0),
            "steps_by_lead": {str(k): v for k, v in sorted(self.counts.items())},
            "cut_closures": self.cut_closures,
        }
