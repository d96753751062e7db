"""Connection settings for the embedded Airflow's SQLite database (imported by Airflow's own settings,
via ``[database] sql_alchemy_connect_args``, so this module imports nothing).

Every Airflow process and every ``airflow`` CLI call writes to the one SQLite file. Python's default
wait for a lock is 5 s; a CLI call (``airflow backfill create``) racing the scheduler on a busy
machine then fails with "database is locked". Writers wait up to a minute instead.

The api-server waits less (the supervisor gives it ``API_SERVER_CONNECT_ARGS``). Airflow 3.3 writes
the audit log of a REST call (``log_action``, e.g. for ``PATCH /dags/{id}``: an unpause) in an async
dependency, so its commit waits for SQLite's write lock on the server's event loop. When the lock is
held by a session of the same server whose commit needs that loop (a sync execution-API route such
as a task's ``PATCH /run``, whose session is closed by the loop after the route returns), neither can
go on until the wait times out, and meanwhile every component of the instance (they all wait on the
same lock) stands still. The shorter wait bounds that stall; the refused call answers 5xx, which
tasks and our REST client retry.
"""

CONNECT_ARGS = {"timeout": 60}
API_SERVER_CONNECT_ARGS = {"timeout": 10}
# As ``[database] sql_alchemy_connect_args`` names them.
CONNECT_ARGS_PATH = f"{__name__}.CONNECT_ARGS"
API_SERVER_CONNECT_ARGS_PATH = f"{__name__}.API_SERVER_CONNECT_ARGS"
