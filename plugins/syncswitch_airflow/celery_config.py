"""Celery workers that start every task warm: Airflow's Celery configuration plus ``imports``.

A Celery worker runs each task in a process forked from its pool, and the pool is forked from the
worker's main process, which imports neither Airflow's DAG parsing nor our DAG's modules: every task
process did so afresh, 9-19 s per task on the test machine (``syncswitch_airflow.warm_start``).

Celery imports the modules of its ``imports`` setting in the main process before it forks the pool,
so every task process inherits them. Use it with::

    [celery]
    celery_config_options = syncswitch_airflow.celery_config.CELERY_CONFIG

(``AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS``), on the workers; the scheduler ignores ``imports``.
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

from syncswitch_airflow.warm_start import WARM_IMPORTS

CELERY_CONFIG = {**DEFAULT_CELERY_CONFIG, "imports": WARM_IMPORTS}
