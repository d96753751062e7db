"""The Airflow that ``syncswitch run`` ships: one supervised instance in the project folder.

- ``airflow``: ``EmbeddedAirflow``, its processes (start, adopt, stop) and its REST client;
- ``instance``: its files, ports and settings; ``boot``: the wait until it serves;
- ``supervisor``: runs the components and restarts any that dies or hangs;
- ``triggerer``, ``sqlite_settings``: its triggerer and SQLite settings;
- ``airflow_api`` over ``airflow_http``: a REST client of any Airflow, this one or a team's.

Nothing in a DAG run imports these; none of them imports Airflow, so the CLI starts fast."""
