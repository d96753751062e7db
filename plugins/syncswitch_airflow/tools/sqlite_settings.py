"""Connection settings for the embedded Airflow's SQLite database (imported by Airflow's own settings,
via ``[database] sql_alchemy_connect_args``, so this module imports nothing).

Every Airflow process and every ``airflow`` CLI call writes to the one SQLite file. Python's default
wait for a lock is 5 s; a CLI call (``airflow backfill create``) racing the scheduler on a busy
machine then fails with "database is locked". Writers wait up to a minute instead.
"""

CONNECT_ARGS = {"timeout": 60}
