"""Helpers shared by the pipeline's operators: the job of a DAG run, its run folder, its state."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, SpecError
from syncswitch.state import State, read_state


def job_from_params(context: Mapping[str, Any]) -> JobSpec:
    """The validated JobSpec of a DAG run; bad params fail the task (no retry) naming the field.

    String params may be templates (a job file's ``data_dir: gs://data/{{ ds }}``): they are rendered
    with the run's context first, so a backfilled date reads its own data. A manual run without a
    logical date renders ``ds`` as empty."""
    task = context["task"]
    params = {
        name: task.render_template(value, context) if _is_template(value) else value
        for name, value in dict(context["params"]).items()
    }
    try:
        return JobSpec.from_params(params)
    except SpecError as err:
        raise AirflowFailException(f"invalid job params: {err}") from None


def _is_template(value: Any) -> bool:
    if isinstance(value, str):
        return "{{" in value
    return isinstance(value, list) and any(isinstance(v, str) and "{{" in v for v in value)


def absolute_bucket_dir(bucket_dir: str) -> str:
    # Every task, the trigger and the cluster processes must agree on one folder.
    return bucket_dir if storage.is_remote(bucket_dir) else os.path.abspath(bucket_dir)


VALIDATE_TASK_ID = "validate"
RUN_KEY_XCOM = "run_key"


def new_run_key(context: Mapping[str, Any]) -> str:
    """The bucket identity of the attempt that starts now (the validate task, first of a run, calls it).

    A DAG run's id, unless the whole run was cleared and runs again: a backfill reprocessing a date
    clears the existing run (Airflow 3), as does "Clear" on the run. That rerun trains afresh in its
    own folder and writes its own history record, under ``<run_id>.rerun<clear number>``."""
    clears = getattr(context["dag_run"], "clear_number", 0) or 0
    return context["run_id"] if not clears else f"{context['run_id']}.rerun{clears}"


def run_key(context: Mapping[str, Any]) -> str:
    """This run's bucket identity as the validate task fixed it. Clearing single tasks (a segment)
    does not rerun validate, so they keep the run's folder and resume there."""
    fixed = context["ti"].xcom_pull(task_ids=VALIDATE_TASK_ID, key=RUN_KEY_XCOM)
    return fixed or context["run_id"]


def run_layout(job: JobSpec, run_id: str) -> RunLayout:
    """The run folder of one DAG run: ``<bucket_dir>/<job_name>/<run_id>/``."""
    return RunLayout.for_run(absolute_bucket_dir(job.bucket_dir), job.job_name, run_id)


def require_state(run_dir: str) -> State:
    state = read_state(RunLayout(run_dir))
    if not state:
        raise AirflowException(f"no state.json in {run_dir}: did the plan task run?")
    return state
