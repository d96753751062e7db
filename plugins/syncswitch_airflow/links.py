"""Extra links on a run's tasks: its report, its bucket folder and its TensorBoard logs, as pages of the
provider's Airflow plugin on the api-server (``syncswitch_airflow.ui``).

In Airflow 3 a link is computed on the worker when the task ends (the task runner calls ``get_link`` and
stores the URL in the task's XCom under ``xcom_key``); the UI only reads that XCom. A link is the page's
URL under ``[api] base_url`` (without one, a path from the server's root, which the UI opens on its own
origin), whatever and wherever the bucket is: a gs:// URI is no address a browser opens, and a local
folder may be on another machine. Tasks that run before the plan (validate, timing_policy,
provision_cluster) have no run folder yet, their rendered ``run_dir`` is empty: no link.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.sdk import BaseOperatorLink

from syncswitch_airflow.ui import FOLDER_PAGE, REPORT_PAGE, TENSORBOARD_PAGE, run_path


def base_url() -> str:
    """``[api] base_url`` without its trailing slash ("" where unset)."""
    from airflow.sdk.configuration import conf

    return (conf.get("api", "base_url", fallback="") or "").rstrip("/")


def run_url(dag_id: str, run_id: str, page: str = "") -> str:
    """A run's page as a browser reaches it: ``[api] base_url`` + :func:`run_path`."""
    return base_url() + run_path(dag_id, run_id, page)


def rendered_run_dir(operator: Any) -> str | None:
    """The task's run folder, or None where the task has none (its template rendered to nothing)."""
    run_dir = getattr(operator, "run_dir", None)
    if not isinstance(run_dir, str) or run_dir in ("", "None") or "{{" in run_dir:
        return None
    return run_dir


class RunLink(BaseOperatorLink):
    """A link to one page of the task's run."""

    name: ClassVar[str]
    page: ClassVar[str]

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        if not rendered_run_dir(operator):
            return ""
        return run_url(ti_key.dag_id, ti_key.run_id, self.page)


class RunReportLink(RunLink):
    name = "Run report"
    page = REPORT_PAGE


class RunFolderLink(RunLink):
    name = "Run bucket folder"
    page = FOLDER_PAGE


class RunTensorBoardLink(RunLink):
    name = "TensorBoard logs"
    page = TENSORBOARD_PAGE


RUN_LINKS = (RunReportLink(), RunFolderLink(), RunTensorBoardLink())
