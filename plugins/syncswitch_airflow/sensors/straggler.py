"""StragglerSensor (``segment_<i>.watch_stragglers``): watches slot ``i`` and applies the online policy.

execute()
    reads state.json; the segment already ended -> returns at once (the ``airflow dags test`` path,
    where the sensor runs after its segment task); else defers to
    :class:`~syncswitch_airflow.triggers.straggler.StragglerTrigger`. No plan entry for the slot ->
    skips every later slot's tasks at once and ends, or is skipped itself where no slot comes later.
execute_complete()
    (the end of a segment or of its task ends the watcher on the triggerer, except the plan's last
    segment's: StragglerTrigger hands that one back, ``plan_ended``)
    plan ended -> skips every later slot's tasks at once (the plan is final once its last segment
    has ended) and ends, so that no task of an unused slot starts only to skip itself;
    verdict -> asks the policy named by the job's ``online_policy``; records the decision in
    state.json. A switch rewrites the plan (plan.insert_switch) in the same state update that records
    the decision, and only then writes the graceful-stop request ``control/stop-seg-ii``, so the
    segment task always finds the plan entry it must run next. After a "stay" the sensor defers again
    and keeps watching (a policy that declined may accept a straggler that lasts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowSkipException, DownstreamTasksSkipped
from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.protocols import family
from syncswitch.state import State, read_state, record_decision, segment_recorded
from syncswitch.state import apply_switch as switch_plan

from syncswitch_airflow import metrics
from syncswitch_airflow.detector import DetectorConfig, Verdict
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.links import RUN_LINKS
from syncswitch_airflow.policies import Decision, PolicyContext, get_policy, measured_switch_gap
from syncswitch_airflow.triggers.straggler import StragglerTrigger, WatchStatus

log = logging.getLogger(__name__)

SWITCH_ACTIONS = ("switch", "switch_back")
SEGMENT_ENDED = "segment already ended"
# What a switch costs before this run has measured one: the local backend's with its warm fork server
# (docs/benchmarks.md), rounded up. Replaced by the run's own figures once a segment has ended.
DEFAULT_SWITCH_GAP_SECONDS = 10.0


class StragglerSensor(BaseSensorOperator):
    """Deferrable watcher of one segment slot. ``run_dir`` and ``slot`` are templated.

    ``segment_tasks`` maps each protocol to the task id of the slot's segment task; the watcher ends
    when that task has finished, whatever the outcome.
    """

    template_fields: Sequence[str] = ("run_dir", "slot")
    operator_extra_links = RUN_LINKS
    ui_color = "#f4d58d"

    def __init__(
        self,
        *,
        run_dir: str,
        slot: int | str,
        segment_tasks: dict[str, str],
        poll_interval: float = 2.0,
        recheck_seconds: float = 30.0,
        detector: dict[str, Any] | None = None,
        default_switch_gap: float = DEFAULT_SWITCH_GAP_SECONDS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.run_dir = run_dir
        self.slot = slot
        self.segment_tasks = dict(segment_tasks)
        self.poll_interval = poll_interval
        self.recheck_seconds = recheck_seconds
        # Validated now, so a bad setting fails when the DAG is parsed rather than on the triggerer.
        self.detector = DetectorConfig.from_dict(detector or {}).to_dict()
        self.default_switch_gap = default_switch_gap

    # ---- execute -------------------------------------------------------------------------------

    @with_bucket_credentials
    def execute(self, context: Any) -> dict[str, Any]:
        layout, slot = RunLayout(self.run_dir), int(self.slot)
        state = read_state(layout) or {}
        item = plans.entry(state.get("plan", []), slot)
        if item is None:
            self._skip_later_slots(state, slot)
        if self._segment_ended(layout, state, item):
            return self._watch_over(state, item, WatchStatus.SEGMENT_ENDED)
        if _runs_tasks_one_at_a_time(context):
            # `airflow dags test` / dag.test() run one task at a time, inline: a deferred sensor would
            # block the segment it waits for (or its retry) from ever running.
            self.log.info(
                "run %s: sequential `dags test` run; straggler watching needs the scheduler, so "
                "segment %d is not watched",
                state.get("run_id"),
                item["index"],
            )
            return self._finish(state, item, WatchStatus.NOT_WATCHED)
        since, workers = _straggler_behind(state, item)
        self._defer(
            context, state, item, start_after=None, straggling_since=since, straggling_workers=workers
        )

    def _watch_over(self, state: State, item: dict[str, Any], status: WatchStatus) -> dict[str, Any]:
        """The watch of ``item`` has ended. Where it was the plan's last segment, the plan is final
        (only this watcher switches online, and not once the segment's result is in): the later
        slots' tasks are skipped now, so that none starts only to skip itself, while the teardown
        waits for it."""
        finished = self._finish(state, item, status)
        if plans.entry(state.get("plan", []), item["index"] + 1) is None and self._later_slot_tasks():
            self._skip_later_slots(state, int(self.slot))
        return finished

    def _later_slot_tasks(self) -> list[str]:
        # Downstream tasks with a slot: the segment tasks and watchers (evaluate and the rest have none).
        return sorted(t.task_id for t in self.get_flat_relatives(upstream=False) if hasattr(t, "slot"))

    def _skip_later_slots(self, state: State, slot: int) -> NoReturn:
        """Skip the tasks of every slot after this one in one go. Left to the scheduler, each slot is
        skipped one scheduling loop after the one before it, and evaluation waits for the last.
        This watcher ends as a success (Airflow's short-circuit idiom). Normally the watcher of the
        plan's last segment does this when that segment ends; the first unused slot's watcher does
        it where that one could not (its trigger found the bucket away), and its slot's segment
        tasks then skip themselves."""
        later = self._later_slot_tasks()
        if not later:
            raise AirflowSkipException(f"slot {slot} is past the end of the plan")
        self.log.info(
            "run %s: the plan ended with %d segment(s); skipping the %d task(s) of the slots after %d",
            state.get("run_id"),
            len(state.get("plan", [])),
            len(later),
            slot,
        )
        raise DownstreamTasksSkipped(tasks=later)

    def _defer(
        self,
        context: Any,
        state: State,
        item: dict[str, Any],
        *,
        start_after: float | None,
        straggling_since: float | None,
        straggling_workers: list[int],
    ) -> NoReturn:
        trigger = StragglerTrigger(
            run_dir=self.run_dir,
            index=item["index"],
            protocol=item["protocol"],
            segment_task={
                "dag_id": context["ti"].dag_id,
                "run_id": context["ti"].run_id,
                "task_id": self.segment_tasks[item["protocol"]],
            },
            poll_interval=self.poll_interval,
            recheck_seconds=self._recheck_seconds(state),
            detector=self.detector,
            start_after=start_after,
            straggling_since=straggling_since,
            straggling_workers=straggling_workers,
        )
        self.defer(trigger=trigger, method_name="execute_complete")

    def _recheck_seconds(self, state: State) -> float:
        """Only a policy that weighs a straggler's duration (elastic) gains from hearing of it again."""
        job = state.get("job", {})
        switches = sum(1 for d in state.get("decisions", []) if d.get("action") in SWITCH_ACTIONS)
        if job.get("online_policy") != "elastic" or switches >= int(job.get("max_online_switches", 0)):
            return 0.0
        return self.recheck_seconds

    @staticmethod
    def _segment_ended(layout: RunLayout, state: State, item: dict[str, Any]) -> bool:
        return segment_recorded(state, item["index"]) or storage.exists(
            layout.segment_result(item["index"], item["protocol"])
        )

    def _finish(self, state: State, item: dict[str, Any], status: WatchStatus) -> dict[str, Any]:
        decisions = [d for d in state.get("decisions", []) if d.get("segment") == item["index"]]
        log.info(
            "run %s segment %d (%s): %s; %d decision(s) recorded",
            state.get("run_id"),
            item["index"],
            item["protocol"],
            status.value.replace("_", " "),
            len(decisions),
        )
        return {
            "status": status.value,
            "segment": item["index"],
            "protocol": item["protocol"],
            "decisions": decisions,
        }

    # ---- execute_complete ----------------------------------------------------------------------

    @with_bucket_credentials
    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        layout, slot = RunLayout(self.run_dir), int(self.slot)
        state = read_state(layout) or {}
        item = plans.entry(state.get("plan", []), slot)
        if item is None:
            raise AirflowSkipException(f"slot {slot} is no longer in the plan")
        if event.get("protocol", item["protocol"]) != item["protocol"]:
            # The plan moved under this slot (a switch in an earlier slot): what it watched is gone.
            return self._finish(state, item, WatchStatus.PLAN_CHANGED)
        if event["status"] == WatchStatus.PLAN_ENDED:
            return self._watch_over(state, item, WatchStatus.PLAN_ENDED)
        verdict = Verdict.from_dict(event["verdict"])
        decision = self._decide(layout, state, item, verdict)
        record = decision_record(state, item, decision, event.get("change"))
        log.info(
            "run %s segment %d (%s): %s straggler -> %s %s: %s",
            state.get("run_id"),
            slot,
            item["protocol"],
            event.get("change"),
            record["policy"],
            decision.action,
            decision.reason,
        )
        dag_id = context["ti"].dag_id
        if decision.action in SWITCH_ACTIONS:
            switched = apply_switch(layout, item, record) is not None
            metrics.decision(record, dag_id, state.get("job_name"), switched=switched)
            return record
        state = record_decision(layout, record)
        metrics.decision(record, dag_id, state.get("job_name"), switched=False)
        if decision.reason == SEGMENT_ENDED:
            return self._watch_over(state, item, WatchStatus.SEGMENT_ENDED)
        self._defer(
            context,
            state,
            item,
            start_after=verdict.window_end,
            straggling_since=verdict.since if verdict.straggling else None,
            straggling_workers=verdict.workers,
        )

    def _decide(self, layout: RunLayout, state: State, item: dict[str, Any], verdict: Verdict) -> Decision:
        if self._segment_ended(layout, state, item):
            return Decision("stay", SEGMENT_ENDED, {"global_step": verdict.global_step})
        context = policy_context(state, item, verdict, self.default_switch_gap)
        return get_policy(state.get("job", {}).get("online_policy", "none")).decide(context)


# ---- state helpers (plain functions: the sensor's logic without Airflow) -------------------------


def policy_context(state: State, item: dict[str, Any], verdict: Verdict, default_gap: float) -> PolicyContext:
    """What a policy needs, from state.json and the verdict."""
    job = state.get("job", {})
    num_workers = max(int(job.get("num_workers", 1)), 1)
    # In ASP and SSP each worker's step is one update of 1/N of a BSP-equivalent step.
    per_worker = family(item["protocol"]).per_worker_updates
    step_time = verdict.step_time / num_workers if per_worker else verdict.step_time
    gap, gap_source = measured_switch_gap(state.get("segments", {}), default_gap)
    return PolicyContext(
        segment_index=item["index"],
        protocol=item["protocol"],
        origin=item.get("origin", "plan"),
        until_step=item["until_step"],
        global_step=verdict.global_step,
        verdict=verdict,
        step_time=step_time,
        switch_gap=gap,
        switch_gap_source=gap_source,
        online_switches=sum(1 for d in state.get("decisions", []) if d.get("action") in SWITCH_ACTIONS),
        max_online_switches=int(job.get("max_online_switches", 0)),
        online_protocol=str(job.get("online_protocol") or "asp"),
    )


def decision_record(
    state: State, item: dict[str, Any], decision: Decision, change: str | None
) -> dict[str, Any]:
    """The entry appended to state.json["decisions"]."""
    return {
        **decision.numbers,
        "run_id": state.get("run_id"),
        "segment": item["index"],
        "protocol": item["protocol"],
        "origin": item.get("origin", "plan"),
        "policy": state.get("job", {}).get("online_policy", "none"),
        "change": change,
        "action": decision.action,
        "reason": decision.reason,
    }


def apply_switch(layout: RunLayout, item: dict[str, Any], record: dict[str, Any]) -> State | None:
    """Record the decision and rewrite the plan in one state update, then request the graceful stop.
    None, and nothing done, where the segment's result was recorded first (the plan then stands)."""
    state = switch_plan(layout, item, record)
    if segment_recorded(state, item["index"]):
        return None
    storage.write_text(layout.stop_request(item["index"]), f"{record['action']}: {record['reason']}\n")
    return state


def _straggler_behind(state: State, item: dict[str, Any]) -> tuple[float | None, list[int]]:
    """For an online segment (a switch away from BSP): when the straggler that caused it began, and
    on which workers.

    The detector then starts in the straggling state and reports when the straggler clears.
    """
    if item.get("origin") != "online" or item["protocol"] == "bsp":
        return None, []
    for decision in reversed(state.get("decisions", [])):
        if decision.get("segment") == item["index"] - 1 and decision.get("action") == "switch":
            since = decision.get("since")
            return (since if since is not None else decision.get("time")), list(decision.get("workers", []))
    return None, []


def _runs_tasks_one_at_a_time(context: Any) -> bool:
    """True under `airflow dags test` / DAG.test(), which marks its runs with this triggering user."""
    dag_run = context.get("dag_run")
    return getattr(dag_run, "triggering_user_name", None) == "dag_test"
