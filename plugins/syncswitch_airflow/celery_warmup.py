"""Imported once by each Celery worker before it forks its pool (``celery_config.WARM_IMPORTS``):
Airflow's plugins and listeners loaded here are inherited by every task process.

A task process asks for the listener manager before it parses the DAG, and the first ask imports
every module of the plugins folder (this provider's operators and hooks, the Google provider's
Compute Engine client): 5 s with compiled bytecode on the test machine, 11 s without, in every task.
The scheduler that forks a LocalExecutor's tasks has done this already; a Celery worker has not.
"""

from __future__ import annotations

from airflow.listeners.listener import get_listener_manager

get_listener_manager()
