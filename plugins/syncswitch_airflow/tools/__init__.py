"""The user's commands beside the Airflow side: ``syncswitch run`` (cli), ``sweep``, ``history`` and
``policy`` (history_cli), and a sweep's comparison report (compare). They drive the embedded Airflow
(``syncswitch_airflow.embedded``) or any Airflow's REST API. Nothing in a DAG run imports these."""
