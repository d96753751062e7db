"""The last task of a run: its outcome, in state.json and in the job's history.

It runs after report and teardown_cluster whatever happened (once both are done: a teardown task of
no setup), so it sees the run's true outcome, which the report task (beside teardown) cannot: it marks
state.json, corrects the report's status, and writes the run's one immutable history record
(syncswitch_airflow.history), failed runs included (they never count as evidence for the timing
policy, but they are part of the job's story).

It is also the run's watcher (the idiom of Airflow's own system tests): as the DAG's only leaf that
counts, it decides the DAG run's state, so once the outcome is recorded it fails when any other task
failed, naming them, or when the run was stopped before its report (the run marked failed by hand:
Airflow fails its running tasks, skips every pending one but the teardown tasks, and leaves the run's
state to its leaves. finalize is a teardown task for that reason, one that fails the run when it
fails: ``on_failure_fail_dagrun``).
"""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException
from syncswitch import usercode
from syncswitch.costs import cost_headline, run_ledger
from syncswitch.layout import RunLayout
from syncswitch.plan import PROTOCOLS
from syncswitch.spec import JobSpec
from syncswitch.state import finish_run, read_state

from syncswitch_airflow import history, metrics
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.operators.common import absolute_bucket_dir, job_from_params, run_key, run_layout

FAILED_STATES = ("failed", "upstream_failed")


class FinalizeRunOperator(BaseOperator):
    """Record the run's outcome; returns the history record."""

    ui_color = "#e8f4fd"

    def __init__(
        self, *, timing_task_id: str = "timing_policy", report_task_id: str = "report", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.timing_task_id = timing_task_id
        self.report_task_id = report_task_id

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        job = job_from_params(context)
        run_id = run_key(context)
        failed = self._failed_tasks(context)
        outcome = "failed" if failed else "success"
        layout = run_layout(job, run_id)
        state = read_state(layout)
        if state is not None:
            # After teardown every VM has ended: this is the run's final bill.
            cost = run_ledger(state)
            state = finish_run(layout, outcome, {"cost": cost} if cost else None)
            self._refresh_report(layout, outcome, state)
            if cost:
                self.log.info(
                    "run %s: cost %.4f %s, %.4f %s saved against on-demand (%.1f%%)",
                    run_id,
                    cost["total"],
                    cost["currency"],
                    cost["savings"],
                    cost["currency"],
                    100 * cost["savings_fraction"],
                )
        decision = context["ti"].xcom_pull(task_ids=self.timing_task_id) or {}
        record = history_record(job, run_id, context, outcome, state, decision)
        written = history.write_record(absolute_bucket_dir(job.bucket_dir), job.job_name, record)
        if written:  # once per outcome: a retried finalize finds its record there
            metrics.run_finished(
                outcome, context["ti"].dag_id, job.job_name, record["final_accuracy"], record["total_seconds"]
            )
        self.log.info(
            "run %s: %s; history record %s (BSP fraction %s, accuracy %s, %s s)",
            run_id,
            outcome,
            "written" if written else "already there",
            record["bsp_fraction"],
            record["final_accuracy"],
            record["total_seconds"],
        )
        if failed:
            raise AirflowFailException(f"run {run_id} failed: {', '.join(failed)}")
        return record

    def _failed_tasks(self, context: Context) -> list[str]:
        """The other tasks of this run that failed; those that could not run because one did only when
        none failed itself (a task marked failed by hand leaves its downstream upstream_failed); the
        report, named as skipped, when none failed but the run was stopped before it."""
        ti = context["ti"]
        states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id, {})
        others = {task: state for task, state in states.items() if task != ti.task_id}
        failed = sorted(task for task, state in others.items() if state == "failed")
        failed = failed or sorted(task for task, state in others.items() if state in FAILED_STATES)
        report = others.get(self.report_task_id)
        if not failed and report is not None and report != "success":
            return [f"{self.report_task_id} ({report}: the run was stopped by hand before its report)"]
        return failed

    def _refresh_report(self, layout: RunLayout, outcome: str, state: dict[str, Any]) -> None:
        from syncswitch_airflow.report import refresh_status

        refresh_status(layout.root, outcome, state)


def history_record(
    job: JobSpec,
    run_id: str,
    context: Context,
    outcome: str,
    state: dict[str, Any] | None,
    decision: dict[str, Any],
) -> dict[str, Any]:
    """The run's history record (docs/history.md). Two values of the job on purpose: ``job`` as
    submitted (the params), whose fingerprint finds the recurring job's earlier runs, and ``planned``
    (state.json), what this run trained (the timing policy's decision in it)."""
    planned = JobSpec.from_params(state["job"]) if state else job
    segments = (state or {}).get("segments", {}).values()
    timings = (state or {}).get("timings", {})
    logical_date = context.get("logical_date")
    started = timings.get("created")
    finished = timings.get("finished") or time.time()
    final = (state or {}).get("final") or {}
    # As planned (state.json): the digest of the files the run trained with, not of today's files.
    user_code = (state or {}).get("user_code")
    if user_code is None:
        user_code = usercode.describe_names(job)
    return {
        "schema_version": 1,
        "job_name": job.job_name,
        "run_id": run_id,
        "dag_id": context["ti"].dag_id,
        "logical_date": logical_date.isoformat() if logical_date else None,
        "status": outcome,
        "bsp_fraction": decision.get("bsp_fraction", planned.planned_bsp_fraction()),
        "switch_order": planned.switch_order,
        "workload_steps": planned.workload,
        "final_accuracy": final.get("test_accuracy") if outcome == "success" else None,
        "total_seconds": finished - started if started else None,
        "training_seconds": {
            protocol: sum(float(s.get("seconds") or 0.0) for s in segments if s.get("protocol") == protocol)
            for protocol in PROTOCOLS
        },
        "fingerprint": history.job_fingerprint(job.to_params(), usercode.identity(user_code)),
        "policy_phase": decision.get("phase", "fixed"),
        "policy": decision or None,
        "started_at": started,
        "finished_at": finished,
        "cost": cost_headline((state or {}).get("cost")),
        **({"user_code": user_code} if user_code else {}),
    }
