"""A run's outputs as Airflow Assets: downstream DAGs run when a job has a newly trained model.

Each job has two assets, named after it (its runs write them, whatever the run's bucket):

    syncswitch://<job>/model    the trained model (SavedModel and .keras), when the run exported one
    syncswitch://<job>/report   the run's report

The job name is a run param, not known when the DAG is parsed, so the report task declares two
aliases as outlets and, at run time, adds the job's assets to them with the run's details as the
event's extra (run id, run folder, files, accuracy). A downstream DAG schedules on one job's asset
(``schedule=[model_asset("digits-nightly")]``) or on every job's models (``schedule=[MODELS]``): see
dags/on_new_model.py.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import Asset, AssetAlias

SCHEME = "syncswitch"
MODELS = AssetAlias(name="syncswitch-models")
REPORTS = AssetAlias(name="syncswitch-reports")


def model_asset(job_name: str) -> Asset:
    return Asset(name=f"{SCHEME}/{job_name}/model", uri=f"{SCHEME}://{job_name}/model", group="model")


def report_asset(job_name: str) -> Asset:
    return Asset(name=f"{SCHEME}/{job_name}/report", uri=f"{SCHEME}://{job_name}/report")


def emit_run_outputs(outlet_events: Any, state: dict[str, Any], report_page: str | None) -> list[str]:
    """Add this run's report (and model, where exported) to the aliases; the URIs of what was added."""
    job_name = state["job_name"]
    final = state.get("final", {})
    run = {
        "run_id": state["run_id"],
        "run_dir": state["run_dir"],
        "test_accuracy": final.get("test_accuracy"),
    }
    added = []
    if report_page:
        asset = report_asset(job_name)
        outlet_events[REPORTS].add(asset, extra={**run, "report": report_page})
        added.append(asset.uri)
    export = final.get("export")
    if export:
        asset = model_asset(job_name)
        outlet_events[MODELS].add(asset, extra={**run, **export})
        added.append(asset.uri)
    return added
