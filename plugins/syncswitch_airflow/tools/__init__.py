"""The user's local tools, beside the Airflow side: ``syncswitch run`` (cli), ``sweep``, ``history``
and ``policy`` (history_cli), the comparison report of a sweep (compare), and the embedded Airflow
they start (embedded, its supervisor and SQLite settings) with a REST client of any Airflow
(airflow_api, over airflow_http). Nothing in a DAG run imports these."""
