"""Recurring Sync-Switch jobs: one DAG per file in jobs/ (or ``[syncswitch] jobs_dir``).

Each job file sets a schedule, its job params (the defaults of every run, backfills included), a
timing policy and tags; see syncswitch_airflow.job_files and docs/recurring-jobs.md. A job file that
does not validate shows here as an import error naming the file and the field, and the other job
DAGs still load.
"""

from __future__ import annotations

from pathlib import Path

from syncswitch_airflow.dag_params import default_bucket_dir
from syncswitch_airflow.job_files import jobs_dir, load_job_dags

PROJECT_DIR = Path(__file__).resolve().parent.parent

for _dag in load_job_dags(jobs_dir(PROJECT_DIR), default_bucket_dir(PROJECT_DIR)):
    globals()[_dag.dag_id] = _dag
