"""SegmentOperator: runs one training segment of the plan, detached, and waits for it deferred.

Slot ``i`` of the DAG has one SegmentOperator per protocol (``segment_<i>_bsp``, ``segment_<i>_asp``).
The one whose protocol matches ``state["plan"]`` entry ``i`` launches the segment on the cluster and
defers to SegmentTrigger; the other skips, and so do both when the plan has no entry ``i``.

The task ends on the triggerer (``end_from_trigger``): when the segment ends, the trigger records its
result in state.json and finishes the task itself, so no worker process is started just to close it,
which is time in every switch gap. Under ``dag.test()`` the trigger's end event comes back to
``execute_complete`` instead.

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
from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch.state import State, straggler_reference_time

from syncswitch_airflow.backends import ClusterError, get_backend
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.links import RUN_LINKS
from syncswitch_airflow.operators.common import require_state
from syncswitch_airflow.triggers.segment import SegmentTrigger, is_finished, read_result, record_result

PROTOCOL_COLORS = {"bsp": "#cfe2f3", "asp": "#fde5cc"}


class SegmentOperator(BaseOperator):
    """Launch plan entry ``slot`` if it runs ``protocol``; defer until the segment ends."""

    template_fields = ("run_dir",)
    operator_extra_links = RUN_LINKS

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

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        state = require_state(self.run_dir)
        entry = plans.entry(state["plan"], self.slot)
        if entry is None:
            raise AirflowSkipException(
                f"the plan has {len(state['plan'])} segment(s); slot {self.slot} is unused"
            )
        if entry["protocol"] != self.protocol:
            raise AirflowSkipException(f"segment {self.slot} runs {entry['protocol']}, not {self.protocol}")
        handle, job = state["cluster"], JobSpec.from_params(state["job"])
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
            self._launch(backend, state, job, entry, stale_result=result is not None)
        self.defer(
            trigger=SegmentTrigger(
                run_dir=self.run_dir,
                index=self.slot,
                protocol=self.protocol,
                until_step=entry["until_step"],
                handle=handle,
                stall_seconds=job.stall_seconds,
                poll_seconds=self.poll_seconds,
                log_seconds=self.log_seconds,
            ),
            method_name="execute_complete",
        )

    def _launch(
        self, backend: Any, state: State, job: JobSpec, entry: dict[str, Any], stale_result: bool
    ) -> None:
        if stale_result:
            # The trigger must not mistake an earlier attempt's result for this one's.
            storage.delete(self.layout.segment_result(self.slot, self.protocol))
        reference = straggler_reference_time(self.layout, self.protocol, time.time())
        spec = job.segment_spec(entry, state["run_id"], state["run_dir"])
        user_code = state.get("user_code") or {}
        spec = spec.replace(
            straggler_reference_time=reference,
            usr_code_uri=user_code.get("uri", ""),
            usr_code_digest=user_code.get("digest", ""),
        )
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

    @with_bucket_credentials
    def execute_complete(self, context: Context, event: Any) -> dict[str, Any]:
        """Only under ``dag.test()``: the trigger already recorded the result, or the failure (its
        reason and the launcher's log tail are in this task's log above)."""
        if event == "success":
            result = read_result(self.run_dir, self.slot, self.protocol)
            return self._record(result)
        raise AirflowException(f"segment {self.slot} ({self.protocol}) failed; see the log above")

    def _record(self, result: dict[str, Any]) -> dict[str, Any]:
        try:
            return record_result(self.run_dir, self.slot, result, self.log)
        except plans.PlanError as err:
            raise AirflowException(f"segment {self.slot} ended at an impossible step: {err}") from None
