"""Extra links on a run's tasks: its report, its bucket folder and its TensorBoard logs.

In Airflow 3 a link is computed on the worker when the task ends (the task runner calls ``get_link``
and stores the URL in the task's XCom under ``xcom_key``); the UI only reads that XCom. So a link
needs only the operator's rendered ``run_dir``: tasks that run before the plan has a run folder
(validate, timing_policy, provision_cluster) carry none.

A ``gs://`` folder links to the Cloud console's bucket browser and the report to its authenticated
object URL; a local folder links as a ``file://`` URL (browsers open it from the same machine only).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink
from syncswitch import storage
from syncswitch.layout import RunLayout, join

CONSOLE_BROWSER = "https://console.cloud.google.com/storage/browser/"
AUTHENTICATED_OBJECT = "https://storage.cloud.google.com/"
REPORT_PAGE = "index.html"


def folder_url(uri: str) -> str:
    """Where a person looks at the folder ``uri``."""
    if storage.is_remote(uri):
        bucket, key = storage.split_gs(uri)
        return CONSOLE_BROWSER + quote(f"{bucket}/{key}".rstrip("/") + "/")
    return "file://" + quote(os.path.abspath(uri) + "/")


def file_url(uri: str) -> str:
    """Where a browser opens the file ``uri`` (an HTML page renders as a page)."""
    if storage.is_remote(uri):
        bucket, key = storage.split_gs(uri)
        return AUTHENTICATED_OBJECT + quote(f"{bucket}/{key}")
    return "file://" + quote(os.path.abspath(uri))


def rendered_run_dir(operator: Any) -> str | None:
    """The task's run folder, or None where the task has none (its template rendered to nothing)."""
    run_dir = getattr(operator, "run_dir", None)
    if not isinstance(run_dir, str) or run_dir in ("", "None") or "{{" in run_dir:
        return None
    return run_dir


class RunLink(BaseOperatorLink):
    """A link to one place of the task's run folder."""

    name: ClassVar[str]

    def target(self, layout: RunLayout) -> str:
        raise NotImplementedError

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        run_dir = rendered_run_dir(operator)
        return self.target(RunLayout(run_dir)) if run_dir else ""


class RunReportLink(RunLink):
    name = "Run report"

    def target(self, layout: RunLayout) -> str:
        return file_url(join(layout.report, REPORT_PAGE))


class RunFolderLink(RunLink):
    name = "Run bucket folder"

    def target(self, layout: RunLayout) -> str:
        return folder_url(layout.root)


class RunTensorBoardLink(RunLink):
    name = "TensorBoard logs"

    def target(self, layout: RunLayout) -> str:
        return folder_url(layout.tensorboard)


RUN_LINKS = (RunReportLink(), RunFolderLink(), RunTensorBoardLink())
