"""SegmentOperator: runs one training segment of the plan, detached, and waits for it deferred.

Slot ``i`` of the DAG has one SegmentOperator per protocol (``segment_<i>.bsp``, ``segment_<i>.asp``,
``.ssp``, ``.local``, ``.cbsp``). The one whose protocol matches ``state["plan"]`` entry ``i`` launches
the segment on the cluster (with the entry's settings, ``protocol_args``) and defers to
SegmentTrigger; the others skip, and so do all when the plan has no entry ``i``. Mostly the
segment is running already: the trigger of segment ``i - 1`` launches entry ``i`` as soon as it has
recorded its own result (``triggers.segment.launch_next``), and the task follows it.

The task ends on the triggerer (``end_from_trigger``): when the segment ends, the trigger records its
result in state.json and finishes the task itself, so no worker process is started just to close it,
which is time in every switch gap. Under ``dag.test()`` the trigger's end event comes back to
``execute_complete`` instead.

Retries: an Airflow retry relaunches the same SegmentSpec, and the runtime resumes it from the run's
latest checkpoint, still stopping exactly at ``until_step``. A retry that finds the segment already
finished (result.json at its target) or still running (the previous attempt died after launching)
does not launch again. The task's own ``retries`` is the ceiling (``MAX_SEGMENT_RETRIES``); a run
gets its job's ``segment_retries`` of them, counted since the task was last cleared. The try that
has none left hands a failure back to ``execute_complete`` rather than ending on the triggerer,
which fails it for good (AirflowFailException); an earlier try's failure ends on the triggerer, and
Airflow retries it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException
from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.events import EventTail
from syncswitch.fields import MAX_SEGMENT_RETRIES
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch.state import State

from syncswitch_airflow.backends import ClusterError, SegmentAlreadyRunning, get_backend
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.links import RUN_LINKS
from syncswitch_airflow.operators.common import require_state
from syncswitch_airflow.triggers.segment import (
    SegmentTrigger,
    is_finished,
    launch_entry,
    launch_next,
    read_result,
    record_result,
)

PROTOCOL_COLORS = {
    "bsp": "#cfe2f3",
    "asp": "#fde5cc",
    "ssp": "#fff2cc",
    "local": "#d9ead3",
    "cbsp": "#d0e0e3",
}


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
        poll_seconds: float = 0.25,
        log_seconds: float = 30.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retries", MAX_SEGMENT_RETRIES)  # a run uses its job's segment_retries
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
        retried = retries_so_far(context["ti"], self.retries)
        event_offsets: dict[str, int] = {}
        # The launcher's status first, then the result: the chief writes result.json before its
        # launcher exits, so a segment that ends between the two looks is seen ended, not launched
        # again (the other order would relaunch a segment that ended just after its result was read).
        if get_backend(handle["backend"]).segment_status(handle, self.slot).running:
            # Launched by the trigger of the segment before, or by an earlier try of this task.
            self.log.info("run %s: segment %d is running; following it", state["run_id"], self.slot)
        else:
            result = read_result(self.run_dir, self.slot, self.protocol)
            if result is not None and is_finished(result, entry):
                self.log.info(
                    "run %s: segment %d already ended; not launching it again", state["run_id"], self.slot
                )
                return self._record(result, context)
            if retried > job.segment_retries:  # a try that ended without handing its failure back
                raise AirflowFailException(self._out_of_retries(retried, job))
            if retried:
                self.log.info(
                    "run %s: segment %d, retry %d of %d, resumes from the last checkpoint",
                    state["run_id"],
                    self.slot,
                    retried,
                    job.segment_retries,
                )
            event_offsets = self._launch(state, job, entry, stale_result=result is not None)
        self.defer(
            trigger=SegmentTrigger(
                run_dir=self.run_dir,
                index=self.slot,
                protocol=self.protocol,
                until_step=entry["until_step"],
                stall_seconds=job.stall_seconds,
                poll_seconds=self.poll_seconds,
                log_seconds=self.log_seconds,
                last_try=retried >= job.segment_retries,
                event_offsets=event_offsets,
            ),
            method_name="execute_complete",
        )

    def _launch(
        self, state: State, job: JobSpec, entry: dict[str, Any], stale_result: bool
    ) -> dict[str, int]:
        """Launch the segment; where its events will begin in the segment's event files."""
        if stale_result:
            # The trigger must not mistake an earlier attempt's result for this one's.
            storage.delete(self.layout.segment_result(self.slot, self.protocol))
        # Nor an earlier try's steps for this one's progress (a retry, or a cleared run, resumes
        # from a checkpoint behind the step its killed try had logged).
        event_offsets = EventTail(self.layout.segment_metrics(self.slot, self.protocol)).skip_existing()
        try:
            launch_entry(self.run_dir, state, entry, self.log, job=job)
        except SegmentAlreadyRunning:
            # Launched at the same moment by the trigger of the segment before: follow that launch.
            self.log.info("run %s: segment %d was just launched; following it", state["run_id"], self.slot)
        except ClusterError as err:
            raise AirflowException(f"cannot launch segment {self.slot}: {err}") from None
        return event_offsets

    @with_bucket_credentials
    def execute_complete(self, context: Context, event: Any) -> dict[str, Any]:
        """Under ``dag.test()``: the trigger already recorded the result, or the failure (its reason
        and the launcher's log tail are in this task's log above). Under the scheduler: the failure
        of the try with no retry left."""
        if event == "success":
            result = read_result(self.run_dir, self.slot, self.protocol)
            return self._record(result, context)
        failed = f"segment {self.slot} ({self.protocol}) failed; see the log above"
        job = JobSpec.from_params(require_state(self.run_dir)["job"])
        retried = retries_so_far(context["ti"], self.retries)
        if retried >= job.segment_retries:
            raise AirflowFailException(f"{failed}. {self._out_of_retries(retried + 1, job)}")
        raise AirflowException(failed)

    def _out_of_retries(self, failures: int, job: JobSpec) -> str:
        return (
            f"Segment {self.slot} has failed {failures} time(s) and its job allows segment_retries="
            f"{job.segment_retries}: the run fails. Clear the task to resume it from its last checkpoint."
        )

    def _record(self, result: dict[str, Any], context: Context) -> dict[str, Any]:
        try:
            summary = record_result(self.run_dir, self.slot, result, self.log, context["ti"].dag_id)
        except plans.PlanError as err:
            raise AirflowException(f"segment {self.slot} ended at an impossible step: {err}") from None
        # As the trigger does: a short segment may end before its trigger starts (the triggerer's
        # loops); nothing then launched the next one yet.
        launch_next(self.run_dir, self.slot, self.protocol, self.log)
        return summary


def retries_so_far(ti: Any, retries: int) -> int:
    """How many times this task instance has been retried since it was last cleared. Airflow counts
    tries across clears: a clear raises ``max_tries`` to the tries so far plus the task's ``retries``,
    so this round's first try is ``max_tries - retries + 1`` (as Airflow's own reschedule lookup
    reads it). Never more than the tries before this one (a run from before a change of ``retries``)."""
    first_try = ti.max_tries - retries + 1
    return max(0, min(ti.try_number - first_try, ti.try_number - 1))
