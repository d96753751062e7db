"""SegmentOperator: runs one training segment of the plan, detached, and waits for it deferred.

Slot ``i`` of the DAG has one SegmentOperator per protocol (``segment_<i>_bsp``, ``segment_<i>_asp``).
The one whose protocol matches ``state["plan"]`` entry ``i`` launches the segment on the cluster and
defers to SegmentTrigger; the other skips, and so do both when the plan has no entry ``i``.

Retries: an Airflow retry relaunches the same SegmentSpec, and the runtime resumes it from the run's
latest checkpoint, still stopping exactly at ``until_step``. A retry that finds the segment already
finished (result.json at its target) or still running (the previous attempt died after launching)
does not launch again.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, SegmentSpec
from syncswitch.state import State, update_state

from syncswitch_airflow import plan as plans
from syncswitch_airflow.backends import ClusterError, get_backend
from syncswitch_airflow.operators.common import require_state
from syncswitch_airflow.triggers.segment import SegmentTrigger, read_result

PROTOCOL_COLORS = {"bsp": "#cfe2f3", "asp": "#fde5cc"}


def original_position(job: JobSpec, until_step: float) -> int:
    """The switch_order position whose offline range ends at or after ``until_step``.

    Online entries carry no ``plan_index``; they take the settings of the original segment they were
    carved from (its target is at or beyond theirs).
    """
    until = 0
    for position, steps in enumerate(job.segment_steps()):
        until += steps
        if until_step <= until:
            return position
    return len(job.switch_order) - 1


def build_segment_spec(state: State, entry: dict[str, Any], reference_time: float | None) -> SegmentSpec:
    """The SegmentSpec of one plan entry: the job's settings for the original segment it belongs to."""
    job = JobSpec.from_params(state["job"])
    position = entry.get("plan_index")
    if position is None:
        position = original_position(job, entry["until_step"])
    spec = job.segment(
        entry["index"],
        entry["protocol"],
        entry["until_step"],
        state["run_id"],
        state["run_dir"],
        hparams=job.per_segment(job.hparams, position),
        ckpt_frequency=job.per_segment(job.ckpt_frequency, position),
    )
    return spec.replace(straggler_reference_time=reference_time)


def is_finished(result: dict[str, Any], entry: dict[str, Any]) -> bool:
    """A result.json that ends this entry: it reached the target, or it was stopped early on purpose."""
    reached = float(result.get("end_step", -1)) == float(entry["until_step"])
    return reached or bool(result.get("stopped_early"))


class SegmentOperator(BaseOperator):
    """Launch plan entry ``slot`` if it runs ``protocol``; defer until the segment ends."""

    template_fields = ("run_dir",)

    def __init__(
        self,
        *,
        slot: int,
        protocol: str,
        run_dir: Any,
        poll_seconds: float = 0.5,
        log_seconds: float = 30.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retries", 1)
        kwargs.setdefault("retry_delay", timedelta(seconds=10))
        super().__init__(**kwargs)
        self.slot = slot
        self.protocol = protocol
        self.run_dir = run_dir
        self.poll_seconds = poll_seconds
        self.log_seconds = log_seconds
        self.ui_color = PROTOCOL_COLORS.get(protocol, "#ffffff")

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    def execute(self, context: Context) -> dict[str, Any]:
        state = require_state(self.run_dir)
        entry = plans.entry(state["plan"], self.slot)
        if entry is None:
            raise AirflowSkipException(
                f"the plan has {len(state['plan'])} segment(s); slot {self.slot} is unused"
            )
        if entry["protocol"] != self.protocol:
            raise AirflowSkipException(f"segment {self.slot} runs {entry['protocol']}, not {self.protocol}")
        handle = state["cluster"]
        result = read_result(self.run_dir, self.slot, self.protocol)
        if result is not None and is_finished(result, entry):
            self.log.info(
                "run %s: segment %d already ended; not launching it again", state["run_id"], self.slot
            )
            return self._record(result)
        backend = get_backend(handle["backend"])
        if backend.segment_status(handle, self.slot).running:
            self.log.info("run %s: segment %d is still running; waiting for it", state["run_id"], self.slot)
        else:
            self._launch(backend, state, entry, stale_result=result is not None)
        self.defer(
            trigger=SegmentTrigger(
                run_dir=self.run_dir,
                index=self.slot,
                protocol=self.protocol,
                until_step=entry["until_step"],
                handle=handle,
                stall_seconds=JobSpec.from_params(state["job"]).stall_seconds,
                poll_seconds=self.poll_seconds,
                log_seconds=self.log_seconds,
            ),
            method_name="execute_complete",
        )

    def _launch(self, backend: Any, state: State, entry: dict[str, Any], stale_result: bool) -> None:
        if stale_result:
            # The trigger must not mistake an earlier attempt's result for this one's.
            storage.delete(self.layout.segment_result(self.slot, self.protocol))
        spec = build_segment_spec(state, entry, self._straggler_reference())
        try:
            record = backend.launch_segment(state["cluster"], spec)
        except ClusterError as err:
            raise AirflowException(f"cannot launch segment {self.slot}: {err}") from None
        self.log.info(
            "run %s: segment %d (%s) launched to step %s (pid %s, log %s)",
            state["run_id"],
            self.slot,
            self.protocol,
            entry["until_step"],
            record.get("pid"),
            record.get("log"),
        )

    def _straggler_reference(self) -> float | None:
        """Injected stragglers count from the first BSP segment's launch, across every segment.

        An ASP segment before any BSP segment has no reference yet: the runtime then counts from its
        own launch.
        """
        now = time.time()
        if self.protocol == "bsp":
            state = update_state(
                self.layout, lambda s: s.setdefault("timings", {}).setdefault("first_bsp_start", now)
            )
        else:
            state = require_state(self.run_dir)
        return state.get("timings", {}).get("first_bsp_start")

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") == "success":
            return self._record(event["result"])
        handle = require_state(self.run_dir)["cluster"]
        # Leave nothing running, so that a retry starts cleanly from the latest checkpoint.
        get_backend(handle["backend"]).stop_segment(handle, self.slot)
        raise AirflowException(
            f"segment {self.slot} ({self.protocol}) failed: {event.get('reason')}\n"
            f"launcher log tail:\n{event.get('log_tail', '')}"
        )

    def _record(self, result: dict[str, Any]) -> dict[str, Any]:
        """Store the SegmentResult; an early stop (online switch) moves this entry's target."""

        def store(state: State) -> None:
            state.setdefault("segments", {})[str(self.slot)] = result
            if result.get("stopped_early"):
                state["plan"] = plans.truncate(state["plan"], self.slot, result["end_step"])

        try:
            state = update_state(self.layout, store)
        except plans.PlanError as err:
            raise AirflowException(f"segment {self.slot} ended at an impossible step: {err}") from None
        self.log.info(
            "run %s: segment %d (%s) ended at step %s in %.1f s (%s examples/s%s)",
            state["run_id"],
            self.slot,
            self.protocol,
            result.get("end_step"),
            float(result.get("seconds") or 0.0),
            _fmt(result.get("examples_per_sec")),
            ", stopped early: " + str(result.get("reason")) if result.get("stopped_early") else "",
        )
        if result.get("checkpoint"):
            self.log.info(
                "run %s: segment %d hands off checkpoint %s", state["run_id"], self.slot, result["checkpoint"]
            )
        return {
            key: result.get(key)
            for key in ("index", "protocol", "start_step", "end_step", "seconds", "stopped_early")
        }


def _fmt(value: Any) -> str:
    return f"{value:.0f}" if isinstance(value, int | float) else "n/a"
