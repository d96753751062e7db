"""The cluster's setup and teardown tasks of ``sync_switch``."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException
from syncswitch.layout import RunLayout
from syncswitch.state import finish_run, read_state

from syncswitch_airflow.backends import ClusterError, get_backend
from syncswitch_airflow.operators.common import job_from_params, run_layout

_FAILED_STATES = ("failed", "upstream_failed")


class ProvisionClusterOperator(BaseOperator):
    """Reserve the run's cluster on the chosen backend; the handle goes to XCom (and into state.json)."""

    ui_color = "#fff4e0"

    def execute(self, context: Context) -> dict[str, Any]:
        job = job_from_params(context["params"])
        backend = get_backend(job.cluster_backend)
        try:
            handle = backend.provision(job, run_layout(job, context["run_id"]))
        except ClusterError as err:
            raise AirflowException(f"cannot provision the {backend.name} cluster: {err}") from None
        self.log.info(
            "run %s: %s cluster ready (%s)", context["run_id"], backend.name, handle.get("work_dir", handle)
        )
        return handle


class TeardownClusterOperator(BaseOperator):
    """Kill every process of the run and free its work folder; marks state.json success or failed.

    Runs as the DAG's teardown task: after success, after a failure and after a manual fail.
    """

    ui_color = "#fff4e0"

    def __init__(self, *, provision_task_id: str = "provision_cluster", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.provision_task_id = provision_task_id

    def execute(self, context: Context) -> dict[str, Any]:
        run_id = context["run_id"]
        handle = context["ti"].xcom_pull(task_ids=self.provision_task_id)
        if not handle:
            self.log.info("run %s: no cluster was provisioned; nothing to tear down", run_id)
            return {}
        try:
            released = get_backend(handle["backend"]).teardown(handle)
        except ClusterError as err:
            raise AirflowException(f"teardown incomplete: {err}") from None
        outcome = self._run_outcome(context)
        self._record(handle.get("run_dir"), outcome, released)
        self.log.info(
            "run %s: teardown done: %d process(es) stopped, %s removed; run %s",
            run_id,
            len(released.get("stopped_pids", [])),
            released.get("work_dir"),
            outcome or "outcome unknown",
        )
        return released

    def _run_outcome(self, context: Context) -> str | None:
        """``failed`` if any other task of this run failed, else ``success``; None if unknown."""
        ti = context["ti"]
        try:
            states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id, {})
        except Exception as err:  # the execution API is optional here: the teardown itself matters
            self.log.warning("run %s: cannot read task states (%s)", ti.run_id, err)
            return None
        others = {task: state for task, state in states.items() if task != ti.task_id}
        return "failed" if any(s in _FAILED_STATES for s in others.values()) else "success"

    def _record(self, run_dir: str | None, outcome: str | None, released: dict[str, Any]) -> None:
        if not run_dir or read_state(RunLayout(run_dir)) is None:
            return

        finish_run(RunLayout(run_dir), outcome)
