"""Deletes what gce runs left behind: VMs past their time limit or of runs that ended, and their
firewall rules (syncswitch_airflow.backends.gce.GceBackend.reap). Every run tears down its own VMs;
this catches a teardown that never ran (a killed scheduler, a deleted DAG run)."""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task


@dag(
    dag_id="sync_switch_reaper",
    schedule="@hourly",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["syncswitch", "gce"],
    params={
        "projects": Param(
            [],
            type="array",
            items={"type": "string", "pattern": "^[a-z][a-z0-9-]{4,28}[a-z0-9]$"},
            title="Projects",
            description="Google Cloud projects whose sync-switch VMs are checked (none: nothing to do).",
        )
    },
    doc_md=__doc__,
)
def sync_switch_reaper() -> None:
    @task
    def reap(params: dict | None = None) -> dict[str, list[str]]:
        from syncswitch_airflow.backends.gce import GceBackend
        from syncswitch_airflow.hooks.bucket import BucketHook

        backend = GceBackend()
        with BucketHook().credentials():  # the runs' state.json, with [syncswitch] gcp_conn_id's key
            return {project: backend.reap(project) for project in (params or {}).get("projects", [])}

    reap()


sync_switch_reaper()
