"""The cluster's setup and teardown tasks of ``sync_switch``."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException
from syncswitch.state import read_state, record_cluster

from syncswitch_airflow.backends import ClusterBusy, ClusterError, get_backend
from syncswitch_airflow.hooks.bucket import with_bucket_credentials
from syncswitch_airflow.operators.common import job_from_params, run_key, run_layout
from syncswitch_airflow.triggers.capacity import ClusterCapacityTrigger


class ProvisionClusterOperator(BaseOperator):
    """Reserve the run's cluster on the chosen backend; its handle goes into the run's state.json,
    its one copy, where the segments and the teardown read it."""

    ui_color = "#fff4e0"

    @with_bucket_credentials
    def execute(self, context: Context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        """Provision; while every cluster slot is taken, wait deferred for one and try again.
        Returns what was provisioned (backend and work folder), for the task's XCom tab."""
        job = job_from_params(context)
        backend = get_backend(job.cluster_backend)
        layout = run_layout(job, run_key(context))
        try:
            handle = backend.provision(job, layout)
        except ClusterBusy as busy:
            self.log.info("run %s: %s; waiting for a free slot", context["run_id"], busy)
            trigger = ClusterCapacityTrigger(backend.name, hosts=list(busy.hosts), need=busy.need)
            self.defer(trigger=trigger, method_name="execute")
        except ClusterError as err:
            raise AirflowException(f"cannot provision the {backend.name} cluster: {err}") from None
        try:
            record_cluster(layout, handle)
        except BaseException:
            # A cluster whose handle is nowhere could never be torn down: release it now.
            backend.teardown(handle)
            raise
        where = handle.get("work_dir") or ", ".join(h["name"] for h in handle.get("hosts", []))
        self.log.info(
            "run %s: %s cluster ready (%s); handle in %s",
            context["run_id"],
            backend.name,
            where,
            layout.state,
        )
        return {"backend": backend.name, "where": where, "state": layout.state}


class TeardownClusterOperator(BaseOperator):
    """Kill every process of the run and free its cluster (the handle in state.json).

    Runs as the DAG's teardown task: after success, after a failure and after a manual fail. The
    run's outcome is recorded after it, by the finalize task.
    """

    ui_color = "#fff4e0"

    @with_bucket_credentials
    def execute(self, context: Context) -> dict[str, Any]:
        run_id = context["run_id"]
        job = job_from_params(context)
        state = read_state(run_layout(job, run_key(context))) or {}
        handle = state.get("cluster")
        if not handle:
            self.log.info("run %s: no cluster was provisioned; nothing to tear down", run_id)
            return {}
        try:
            released = get_backend(handle["backend"]).teardown(handle)
        except ClusterError as err:
            raise AirflowException(f"teardown incomplete: {err}") from None
        self.log.info(
            "run %s: teardown done: %d process(es) stopped, %s removed",
            run_id,
            len(released.get("stopped_pids", [])),
            released.get("work_dir"),
        )
        return released
