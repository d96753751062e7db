"""Recurring jobs defined in files: each ``jobs/*.yaml`` becomes one Sync-Switch DAG.

    # jobs/digits-nightly.yaml
    description: Digits, every night, learning its own switch point
    schedule: "@daily"            # a cron expression or preset, {every: 6h} (an interval), or null
    start_date: 2026-11-01        # needed with a schedule (backfills start from it)
    end_date: null                # optional: no scheduled run after this date
    catchup: false
    max_active_runs: 1
    tags: [digits]
    params:                       # JobSpec fields (the names of the CLI flags and the Trigger form):
      job_name: digits-nightly    # the defaults of every run of this DAG
      total_steps: 400
      timing_policy: search
      timing_repeats: 1

The DAG id is ``job_<file name>`` (``-`` becomes ``_``) unless ``dag_id`` says otherwise; ``job_name``
defaults to the file name. A file that does not validate breaks no other DAG: it becomes an import
error of the loader file (dags/recurring_jobs.py) naming the file and the field, as Airflow reports a
DAG that fails its own validation.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from airflow.sdk import DAG
from syncswitch import usercode
from syncswitch.spec import JobSpec, SpecError

from syncswitch_airflow import settings
from syncswitch_airflow.dag_factory import build_sync_switch_dag
from syncswitch_airflow.dag_params import build_params, deployment_defaults, with_deployment_bucket

KEYS = (
    "dag_id",
    "description",
    "schedule",
    "start_date",
    "end_date",
    "catchup",
    "max_active_runs",
    "tags",
    "params",
)
_DAG_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_INTERVAL_RE = re.compile(r"^(\d+)\s*([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class JobFileError(ValueError):
    """A job file that does not validate: the message names the file and the field."""

    def __init__(self, path: Path, field_name: str, message: str) -> None:
        super().__init__(f"{path.name}: {field_name}: {message}")
        self.path, self.field = path, field_name


@dataclass(frozen=True)
class JobFile:
    """A validated job file."""

    path: Path
    dag_id: str
    job: JobSpec
    schedule: Any
    start_date: datetime.datetime | None
    end_date: datetime.datetime | None
    catchup: bool
    max_active_runs: int
    tags: list[str]
    description: str


def read_job_file(path: Path) -> JobFile:
    """Parse and validate one job file; JobFileError names the file and the field."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise JobFileError(path, "file", f"is not readable YAML: {exc}") from None
    if not isinstance(data, dict):
        raise JobFileError(path, "file", "must be a YAML mapping of " + ", ".join(KEYS))
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise JobFileError(path, unknown[0], f"unknown key; accepted: {', '.join(KEYS)}")
    stem = path.stem
    dag_id = str(data.get("dag_id") or "job_" + stem.replace("-", "_"))
    if not _DAG_ID_RE.match(dag_id):
        raise JobFileError(path, "dag_id", f"{dag_id!r} must be letters, digits, '_', '.' or '-'")
    params = data.get("params") or {}
    if not isinstance(params, dict):
        raise JobFileError(path, "params", "must be a mapping of job settings (JobSpec fields)")
    try:
        own = {"job_name": stem, **usercode.beside(params, str(path.parent))}
        defaults = deployment_defaults()
        job = JobSpec.from_params(with_deployment_bucket({**defaults, **own}) if defaults else own)
    except SpecError as err:
        raise JobFileError(path, f"params.{err.field}", str(err).split(": ", 1)[-1]) from None
    schedule = _schedule(path, data.get("schedule"))
    start_date = _start_date(path, data.get("start_date"), schedule)
    end_date = _date(path, "end_date", data.get("end_date"))
    if end_date is not None and (start_date is None or end_date < start_date):
        raise JobFileError(
            path,
            "end_date",
            f"must be on or after start_date ({start_date:%Y-%m-%d})" if start_date else "needs a start_date",
        )
    return JobFile(
        path=path,
        dag_id=dag_id,
        job=job,
        schedule=schedule,
        start_date=start_date,
        end_date=end_date,
        catchup=_bool(path, "catchup", data.get("catchup", False)),
        max_active_runs=_positive_int(path, "max_active_runs", data.get("max_active_runs", 1)),
        tags=_tags(path, data.get("tags", [])),
        description=str(data.get("description") or f"Recurring Sync-Switch job {job.job_name} ({path.name})"),
    )


def _schedule(path: Path, value: Any) -> Any:
    """None, a cron expression or preset (validated by Airflow's own timetable), or a timedelta."""
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"every"}:
        match = _INTERVAL_RE.match(str(value["every"]).strip())
        if not match:
            raise JobFileError(path, "schedule.every", f"{value['every']!r} must be like 30m, 6h or 1d")
        return datetime.timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    if not isinstance(value, str):
        raise JobFileError(path, "schedule", "must be a cron expression or preset, {every: 6h}, or null")
    from airflow.sdk import CronTriggerTimetable

    try:
        CronTriggerTimetable(value, timezone="UTC").validate()
    except Exception as exc:  # noqa: BLE001 - Airflow's own validation, whatever it raises
        raise JobFileError(path, "schedule", f"{value!r} is not a cron expression or preset: {exc}") from None
    return value


def _start_date(path: Path, value: Any, schedule: Any) -> datetime.datetime | None:
    if value is None and schedule is not None:
        raise JobFileError(path, "start_date", "is needed with a schedule (e.g. 2026-11-01)")
    return _date(path, "start_date", value)


def _date(path: Path, name: str, value: Any) -> datetime.datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        moment = value
    elif isinstance(value, datetime.date):
        moment = datetime.datetime(value.year, value.month, value.day)
    else:
        try:
            moment = datetime.datetime.fromisoformat(str(value))
        except ValueError:
            raise JobFileError(path, name, f"{value!r} is not a date (YYYY-MM-DD)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


def _bool(path: Path, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise JobFileError(path, name, f"must be true or false, got {value!r}")
    return value


def _positive_int(path: Path, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobFileError(path, name, f"must be an integer >= 1, got {value!r}")
    return value


def _tags(path: Path, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise JobFileError(path, "tags", f"must be a list of strings, got {value!r}")
    return value


# ---- DAGs ------------------------------------------------------------------------------------------


def build_job_dag(job_file: JobFile, bucket_dir: str) -> DAG:
    """The Sync-Switch DAG of one job file, its params defaulting to the file's settings."""
    job = job_file.job
    return build_sync_switch_dag(
        job_file.dag_id,
        build_params(bucket_dir, job),
        schedule=job_file.schedule,
        start_date=job_file.start_date,
        end_date=job_file.end_date,
        catchup=job_file.catchup,
        max_active_runs=job_file.max_active_runs,
        tags=["recurring", *job_file.tags],
        description=job_file.description,
        doc_md=f"Recurring Sync-Switch job from `{job_file.path.name}`.\n\n{job_file.description}",
    )


class InvalidJobFiles(DAG):
    """Stands for the job files that did not validate: Airflow records a DAG that fails validation as
    an import error of the file that defined it, without touching the other DAGs of that file."""

    def validate(self) -> None:
        raise ValueError(f"invalid job file(s) in {self.doc_md}: {self.description}")


def jobs_dir(project_dir: Path) -> Path:
    """``[syncswitch] jobs_dir``, else ``<project>/jobs``."""

    return Path(settings.get("jobs_dir") or Path(project_dir) / "jobs")


def load_job_dags(jobs_dir: Path, bucket_dir: str) -> list[DAG]:
    """One DAG per valid job file in ``jobs_dir``, plus one InvalidJobFiles for all the invalid ones."""
    dags, errors = [], []
    for path in sorted(jobs_dir.glob("*.yaml")) + sorted(jobs_dir.glob("*.yml")):
        try:
            dags.append(build_job_dag(read_job_file(path), bucket_dir))
        except JobFileError as err:
            errors.append(str(err))
    if errors:
        # Its validate() raises with every error: Airflow shows them as the loader file's import error.
        dags.append(
            InvalidJobFiles(
                dag_id="syncswitch_invalid_job_files",
                description="; ".join(errors),
                doc_md=str(jobs_dir),
                schedule=None,
            )
        )
    return dags
