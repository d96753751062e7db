"""Celery workers that start every task warm: Airflow's Celery configuration plus ``imports``.

A Celery worker runs each task in a process forked from its pool, and the pool is forked from the
worker's main process, which imports neither Airflow's DAG parsing nor our DAG's modules: every task
process would import them afresh (``syncswitch_airflow.warm_start``).

Celery imports the modules of its ``imports`` setting in the main process before it forks the pool,
so every task process inherits them. Use it with::

    [celery]
    celery_config_options = syncswitch_airflow.celery_config.CELERY_CONFIG

(``AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS``), on the workers; the scheduler ignores ``imports``.
A worker that loads this module also reaps its task processes as soon as they exit
(``warm_start.reap_exiting_processes``), from the main process on, before the pool forks, and
says in one line of its log, once it is ready, whether its pool forked with both in effect.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init, worker_ready

from syncswitch_airflow.warm_start import (
    WARM_IMPORTS,
    reap_exiting_processes,
    reaps_exiting_processes,
)

log = logging.getLogger(__name__)

CELERY_CONFIG = {**DEFAULT_CELERY_CONFIG, "imports": WARM_IMPORTS}


@worker_init.connect(weak=False)
def reap_task_processes_promptly(**_signal: Any) -> None:
    """Celery's ``worker_init``: sent in a worker's main process before its pool forks (never in the
    scheduler, which loads this configuration too)."""
    reap_exiting_processes()


@worker_ready.connect(weak=False)
def report_warm_task_starts(**_signal: Any) -> None:
    """Celery's ``worker_ready``, in the main process after its pool forked: what this process holds
    is what the pool's processes inherited, so an operator can see that the settings took effect."""
    not_imported = [name for name in WARM_IMPORTS if name not in sys.modules]
    reaping = reaps_exiting_processes()
    if not_imported or not reaping:
        log.warning(
            "task processes may start slowly: modules not imported before the pool forked: %s; "
            "task processes reaped as they exit: %s",
            ", ".join(not_imported) or "none",
            reaping,
        )
        return
    log.info(
        "task processes start warm (%d modules imported before the pool forked) and are reaped as they exit",
        len(WARM_IMPORTS),
    )
