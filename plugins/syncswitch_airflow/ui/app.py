"""The plugin's FastAPI app, mounted by the api-server at ``ui.URL_PREFIX``: a run's report, its folder
page and its sweep's comparison, read from the run's bucket at each request.

Rules:

- Airflow's own auth guards every route: the app depends on ``requires_access_dag("GET", RUN)`` for the
  ``dag_id`` of the path, as the REST API's DAG-run routes do. A request without a valid session cookie
  or token is refused with 401 (403 for an invalid one), a user without access to the DAG's runs with 403.
- The run folder is the DAG run's ``plan`` XCom (``PLAN_TASK_ID``), the very value every later
  task renders as its ``run_dir``: it names the rerun folder of a cleared run and a bucket_dir rendered
  from a template, which the run's conf and the DAG's params alone do not.
- The bucket is read as the tasks read it: ``syncswitch.storage`` (local folders and ``gs://``, the GCS
  emulator through ``STORAGE_EMULATOR_HOST``) with the client of ``[syncswitch] gcp_conn_id``
  (``BucketHook``), made per request, so a connection changed in the UI counts at once.
- Only files below the run's ``report/`` (and its sweep's folder) are served, never a path with ``..``:
  the run folder also holds the cluster's secrets.
- The pages run no script (Content-Security-Policy): a bucket's writer cannot put one into Airflow's
  origin, where the tab's iframe shows it.
"""

from __future__ import annotations

import contextlib
import html
import mimetypes
import os
from collections.abc import Iterator
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from syncswitch import storage
from syncswitch.layout import SWEEPS_DIR, RunLayout, SweepLayout, join

from syncswitch_airflow.ui import PLAN_TASK_ID, REPORT_PAGE

HEADERS = {
    # A report changes while its run ends (finalize rewrites index.html and summary.json).
    "Cache-Control": "private, no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; frame-ancestors 'self'"
    ),
}
PAGE_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
td.num { text-align: right; } pre { background: #f5f5f5; padding: 0.6em; overflow-x: auto; }
.note { color: #666; }
"""

app = FastAPI(
    title="Sync-Switch run pages",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.RUN))],
)


class Missing(Exception):
    """What the page would show is not there (yet); the message says what and why."""


@app.exception_handler(Missing)
def _missing(_request: Request, exc: Missing) -> HTMLResponse:
    body = f"<p>{html.escape(str(exc))}</p>"
    return HTMLResponse(page("Not there", body), status_code=404, headers=HEADERS)


@app.exception_handler(storage.BucketUnavailable)
def _unavailable(_request: Request, exc: storage.BucketUnavailable) -> HTMLResponse:
    body = f"<p>The bucket does not answer: {html.escape(str(exc))}</p>"
    return HTMLResponse(page("Bucket unavailable", body), status_code=503, headers=HEADERS)


@app.get("/runs/{dag_id}/{run_id}/report/{path:path}")
def report_file(dag_id: str, run_id: str, path: str, session: SessionDep) -> Response:
    """A file of the run's report; its ``index.html`` for the folder itself."""
    layout = run_layout(session, dag_id, run_id)
    with bucket_credentials():
        return bucket_file(layout.report, path or "index.html", f"the report of {run_id}")


@app.get("/runs/{dag_id}/{run_id}/folder")
def run_folder(dag_id: str, run_id: str, session: SessionDep) -> HTMLResponse:
    """Where the run folder is, what it holds, and how to open its TensorBoard logs."""
    layout = run_layout(session, dag_id, run_id)
    with bucket_credentials():
        sizes = storage.file_sizes(layout.root)
    return HTMLResponse(folder_page(dag_id, run_id, layout, sizes), headers=HEADERS)


@app.get("/runs/{dag_id}/{run_id}/sweep/{path:path}")
def sweep_file(dag_id: str, run_id: str, path: str, session: SessionDep) -> Response:
    """A file of the comparison report of the sweep the run is part of; ``comparison.html`` for the
    folder itself."""
    layout = run_layout(session, dag_id, run_id)
    with bucket_credentials():
        sweep = sweep_of(layout, run_id)
        return bucket_file(sweep.root, path or os.path.basename(sweep.page), f"the sweep of {run_id}")


# ---- the run, its bucket ------------------------------------------------------------------------


def run_layout(session: Any, dag_id: str, run_id: str) -> RunLayout:
    """The DAG run's folder, as its plan task recorded it."""
    from airflow.models.xcom import XCOM_RETURN_KEY, XComModel

    query = XComModel.get_many(
        run_id=run_id,
        key=XCOM_RETURN_KEY,
        task_ids=PLAN_TASK_ID,
        dag_ids=dag_id,
        map_indexes=-1,
        limit=1,
    )
    row = session.scalars(query).first()
    run_dir = XComModel.deserialize_value(row) if row is not None else None
    if not isinstance(run_dir, str) or not run_dir:
        raise Missing(
            f"{dag_id} / {run_id} has no run folder: it is not a Sync-Switch run, or its plan task has "
            "not run yet."
        )
    return RunLayout(run_dir)


@contextlib.contextmanager
def bucket_credentials() -> Iterator[None]:
    """The block's bucket calls with the tasks' client (imported here: the Google provider's hook is
    not needed to start the api-server)."""
    from syncswitch_airflow.hooks.bucket import BucketHook

    with BucketHook().credentials():
        yield


def bucket_file(folder: str, path: str, what: str) -> Response:
    """The file ``path`` below ``folder`` (a relative path without ``.`` or ``..`` parts)."""
    from google.api_core.exceptions import NotFound

    parts = path.split("/")
    if any(part in ("", ".", "..") or "\\" in part for part in parts):
        raise Missing(f"{path!r} is not a file of {what}.")
    uri = join(folder, *parts)
    try:
        data = storage.read_bytes(uri)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, NotFound):
        raise Missing(
            f"{what} has no {path} ({uri}): a run writes its report when its training has ended."
        ) from None
    media_type = mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
    return Response(data, media_type=media_type, headers=HEADERS)


def sweep_of(layout: RunLayout, run_id: str) -> SweepLayout:
    """The sweep whose record lists this run, in the run's bucket: a sweep's jobs are
    ``<sweep>-<label>``, so its name is one of the job name's prefixes before a '-'. A sweep reported
    elsewhere (``syncswitch sweep --out``) is not found."""
    job = layout.job_name
    job_folder = layout.root.rsplit("/", 1)[0] + "/"
    for cut in (i for i, char in enumerate(job) if char == "-"):
        sweep = SweepLayout.for_sweep(layout.bucket_dir, job[:cut])
        runs = storage.read_json(sweep.progress, default={}).get("runs", [])
        if any(r.get("run_id") == run_id and str(r.get("run_dir", "")).startswith(job_folder) for r in runs):
            return sweep
    raise Missing(f"{run_id} is part of no sweep reported in {join(layout.bucket_dir, SWEEPS_DIR)}/.")


# ---- pages --------------------------------------------------------------------------------------


def page(title: str, body: str) -> str:
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{PAGE_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )


def folder_page(dag_id: str, run_id: str, layout: RunLayout, sizes: dict[str, int]) -> str:
    """The run folder's URI, its top-level entries (files and bytes), and the TensorBoard command."""
    base = layout.root.rstrip("/") + "/"
    entries: dict[str, list[int]] = {}
    for uri, size in sizes.items():
        top, _, rest = uri.removeprefix(base).partition("/")
        entry = entries.setdefault(top + "/" if rest else top, [0, 0])
        entry[0] += 1
        entry[1] += size
    rows = "".join(
        f"<tr><td>{_entry_cell(name)}</td><td class=num>{count}</td><td class=num>{total:,}</td></tr>"
        for name, (count, total) in sorted(entries.items())
    )
    listing = (
        f"<table><tr><th>entry</th><th>files</th><th>bytes</th></tr>{rows}</table>"
        if rows
        else '<p class="note">Nothing yet.</p>'
    )
    root = html.escape(layout.root)
    tensorboard = html.escape(layout.tensorboard)
    body = f"""<p>{html.escape(dag_id)} / {html.escape(run_id)}</p>
<p><code>{root}</code></p>
<p><a href="{REPORT_PAGE}">The run's report</a></p>
<h2>Contents</h2>
{listing}
<h2 id="tensorboard">TensorBoard</h2>
<p>The run's scalars (loss, examples/s, learning rate, momentum, test metrics: one curve across its
segments, tagged by protocol too) are TensorBoard event files; open them with</p>
<pre>tensorboard --logdir {tensorboard}</pre>
{_tensorboard_note(layout)}"""
    return page("Run folder", body)


def _entry_cell(name: str) -> str:
    if name == "report/":
        return f'<a href="{REPORT_PAGE}">report/</a>'
    return html.escape(name)


def _tensorboard_note(layout: RunLayout) -> str:
    """Where that command works, and the copy to open where it does not."""
    if not storage.is_remote(layout.root):
        return '<p class="note">On the machine that holds the folder.</p>'
    folder = html.escape(layout.tensorboard)
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # TensorBoard reads gs:// through TensorFlow's own GCS client, whose endpoint is fixed.
        copy = f"python -c \"from syncswitch import storage; storage.download_dir('{folder}', 'tb')\""
        return (
            '<p class="note">This bucket is a GCS emulator, which TensorBoard cannot read: copy the '
            f"folder down with the emulator set (STORAGE_EMULATOR_HOST) and open the copy:</p>"
            f"<pre>{copy}\ntensorboard --logdir tb</pre>"
        )
    return (
        '<p class="note">TensorBoard reads gs:// with your Google credentials (gcloud auth '
        "application-default login), or open a copy:</p>"
        f"<pre>gcloud storage cp -r {folder} tb\ntensorboard --logdir tb</pre>"
    )
