"""Celery workers that start every task warm: Airflow's Celery configuration plus ``imports``.

A Celery worker runs each task in a process forked from its pool, and the pool is forked from the
worker's main process. Under the LocalExecutor that chain starts at the scheduler, which has imported
Airflow's DAG parsing and the DAG's modules long before: a task starts in under a second. The Celery
worker's main process has imported neither, so every task process did it afresh (with the plugins
folder's loose modules, which ``plugins/.airflowignore`` now skips, and without compiled bytecode):
9-19 s per task on the test machine, between the task log's "Pre Execute" and "DAG bundles loaded"
lines, most of the Celery deployment's overhead per run.

Celery imports the modules of its ``imports`` setting in the main process before it forks the pool,
so every task process inherits them. Use it with::

    [celery]
    celery_config_options = syncswitch_airflow.celery_config.CELERY_CONFIG

(``AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS``), on the workers; the scheduler ignores ``imports``.
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

# What a task process needs before it runs a line of ours, then our DAG file's own modules.
WARM_IMPORTS = (
    "airflow.sdk.execution_time.supervisor",
    "airflow.sdk.execution_time.task_runner",
    "airflow.dag_processing.bundles.manager",
    "airflow.dag_processing.dagbag",
    "syncswitch_airflow.dag_factory",
)

CELERY_CONFIG = {**DEFAULT_CELERY_CONFIG, "imports": WARM_IMPORTS}
