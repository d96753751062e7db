"""Celery workers that start every task warm: Airflow's Celery configuration plus ``imports``.

A Celery worker runs each task in a process forked from its pool, and the pool is forked from the
worker's main process, which imports neither Airflow's DAG parsing nor our DAG's modules: every task
process did so afresh, 9-19 s per task on the test machine (``syncswitch_airflow.warm_start``).

Celery imports the modules of its ``imports`` setting in the main process before it forks the pool,
so every task process inherits them. Use it with::

    [celery]
    celery_config_options = syncswitch_airflow.celery_config.CELERY_CONFIG

(``AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS``), on the workers; the scheduler ignores ``imports``.
A worker that loads this module also reaps its task processes as soon as they exit
(``warm_start.reap_exiting_task_processes``), from the main process on, before the pool forks.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init

from syncswitch_airflow.warm_start import WARM_IMPORTS, reap_exiting_task_processes

CELERY_CONFIG = {**DEFAULT_CELERY_CONFIG, "imports": WARM_IMPORTS}


@worker_init.connect(weak=False)
def reap_task_processes_promptly(**_signal: Any) -> None:
    """Celery's ``worker_init``: sent in a worker's main process before its pool forks (never in the
    scheduler, which loads this configuration too)."""
    reap_exiting_task_processes()
