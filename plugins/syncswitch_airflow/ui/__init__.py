"""The provider's Airflow plugin: a DAG run's report as a "Report" tab of the run in the Airflow UI, and
the pages that the run's extra links open (``syncswitch_airflow.links``).

``plugin`` declares it (Airflow loads it through the ``airflow.plugins`` entry point of this
distribution, in every component); ``app`` is the FastAPI app that the api-server mounts, imported
only there. This module is their URL scheme, and imports nothing (the ``syncswitch`` CLI uses it before
Airflow is imported). The api-server serves, under ``[api] base_url``::

    /syncswitch/runs/<dag_id>/<run_id>/report/      the run's report: any file of <run>/report/,
                                                    index.html for the folder (the Report tab)
    /syncswitch/runs/<dag_id>/<run_id>/folder       the run folder: its URI, its entries, and the
                                                    TensorBoard command (#tensorboard)
    /syncswitch/runs/<dag_id>/<run_id>/sweep/       the comparison of the sweep the run is part of

A page finds the run folder from the DAG run: the return value (XCom) of its ``plan`` task, which every
later task renders as its ``run_dir`` (dag_factory.RUN_DIR). A run before its plan has none.
"""

from __future__ import annotations

from urllib.parse import quote

URL_PREFIX = "/syncswitch"  # where the api-server mounts the app
PLAN_TASK_ID = "plan"  # its XCom return value is the DAG run's run folder
REPORT_PAGE = "report/"
FOLDER_PAGE = "folder"
TENSORBOARD_PAGE = "folder#tensorboard"
SWEEP_PAGE = "sweep/"


def run_path(dag_id: str, run_id: str, page: str = "") -> str:
    """The path of a run's page below the api-server's root; ids quoted whole (a run id has ':' and '+')."""
    return f"{URL_PREFIX}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}/{page}"
