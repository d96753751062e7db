"""Sync-Switch, triggered by hand (UI, REST, ``syncswitch run``): train BSP first, switch to ASP;
online policies react to stragglers. Every param of the Trigger form is a job setting (JobSpec).

The DAG's structure is syncswitch_airflow.dag_factory's; recurring jobs (jobs/*.yaml) get the same
DAG with a schedule of their own (dags/recurring_jobs.py). See docs/architecture.md.
"""

from __future__ import annotations

from pathlib import Path

from syncswitch_airflow.dag_factory import build_sync_switch_dag
from syncswitch_airflow.dag_params import build_params, default_bucket_dir, default_job

PROJECT_DIR = Path(__file__).resolve().parent.parent

dag = build_sync_switch_dag(
    "sync_switch",
    # The deployment's defaults ([syncswitch] default_params), else the digits demo on a local cluster.
    build_params(default_bucket_dir(PROJECT_DIR), default_job()),
    doc_md=__doc__,
    tags=["training"],
    # Runs triggered together (users, a sweep) all start; each waits for a cluster at provision_cluster,
    # deferred, holding no worker slot: the backends' capacity ([syncswitch] local_clusters,
    # hosts_clusters, gce_clusters; one local cluster by default) bounds how many train at once.
    max_active_runs=16,
)
