"""A run's report as the "Report" tab of its DAG run, in the real Airflow UI (tests/browser.py) on the
session's embedded Airflow: a short run whose bucket is a gs:// bucket of the session's GCS emulator,
read by the api-server through the bucket connection as the tasks read it. Its tab shows the report
with the accuracy plot; its folder page and its sweep's comparison are served the same way; a request
without a login is refused.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from airflow_runs import DAG_ID, trigger, wait_run
from browser import logged_in_page, needs_chromium
from conftest import new_bucket
from proc_utils import wait_for
from syncswitch.layout import SweepLayout
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.embedded.boot import wait_healthy

pytestmark = [pytest.mark.airflow, pytest.mark.cluster, needs_chromium]

SWEEP = "uitab"  # the run's job is one config of this sweep: <sweep>-<label>


@pytest.fixture
def page(embedded_airflow: EmbeddedAirflow) -> Iterator:  # noqa: ANN201 - playwright Page
    with logged_in_page(embedded_airflow) as page:
        yield page


def get_from(airflow: EmbeddedAirflow) -> Callable[..., tuple[int, str, bytes]]:
    """``get(url, token=None)``: status, content type and body of ``GET url`` (any status), waiting
    for an api-server that its supervisor restarts, as the REST client does."""

    def once(url: str, token: str | None) -> tuple[int, str, bytes]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as answer:
                return answer.status, answer.headers.get("Content-Type", ""), answer.read()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.headers.get("Content-Type", ""), refused.read()

    return lambda url, token=None: airflow.api.answered(lambda: once(url, token))


def test_the_report_tab_shows_the_runs_report_from_its_gs_bucket(
    page, embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:  # noqa: ANN001
    airflow = embedded_airflow
    bucket_dir = f"{new_bucket('report-tab')}/runs"
    conf = {"job_name": f"{SWEEP}-bsp", "bucket_dir": bucket_dir, "switch_order": "1", "total_steps": 40}
    run_id, layout = trigger(airflow, conf)
    assert wait_run(airflow, run_id) == "success"
    wait_healthy(airflow, time.monotonic() + 180)

    # The finished run, then its Report tab: the report's page in the tab's iframe, its plots loaded.
    page.goto(f"{airflow.url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}")
    page.get_by_role("link", name="Report", exact=True).click()
    page.wait_for_url("**/plugin/syncswitch-report")
    report = page.frame_locator("iframe[title='Report']")
    report.get_by_role("heading", name=f"syncswitch report: {SWEEP}-bsp / {run_id}").wait_for()
    accuracy = report.locator("img[alt='accuracy']")
    wait_for(
        lambda: accuracy.evaluate("img => img.complete && img.naturalWidth > 0"),
        timeout=30,
        what="the accuracy plot loaded",
    )
    accuracy.evaluate("img => img.scrollIntoView({block: 'center'})")  # all of it in the tab's view
    screenshot = tmp_path / "report-tab.png"
    page.screenshot(path=str(screenshot))
    # The plot is in the screenshot: inside the page's viewport, at its drawn size.
    box, viewport = accuracy.bounding_box(), page.viewport_size
    assert box is not None and viewport is not None and box["height"] > 200, box
    assert box["y"] >= 0 and box["y"] + box["height"] <= viewport["height"], (box, viewport)
    assert screenshot.read_bytes().startswith(b"\x89PNG"), screenshot
    print(f"screenshot of the Report tab: {screenshot}")

    # Airflow's own auth: no session or token, or a forged token, is refused.
    get = get_from(airflow)
    run_url = f"{airflow.url}/syncswitch/runs/{DAG_ID}/{quote(run_id, safe='')}"
    for path in ("report/", "report/accuracy.png", "folder", "sweep/"):
        assert get(f"{run_url}/{path}")[0] in (401, 403), path
    assert get(f"{run_url}/report/", token="not-a-token")[0] in (401, 403)

    token = airflow.api.token()
    status, kind, body = get(f"{run_url}/report/accuracy.png", token)
    assert (status, kind) == (200, "image/png") and body.startswith(b"\x89PNG")
    status, _, body = get(f"{run_url}/report/summary.json", token)
    assert status == 200 and b'"final_accuracy"' in body
    # Nothing outside report/ (the run folder holds the cluster's secrets too); a run with no folder.
    assert get(f"{run_url}/report/../state.json", token)[0] == 404
    assert get(f"{run_url}/report/..%2Fstate.json", token)[0] == 404
    assert get(f"{airflow.url}/syncswitch/runs/{DAG_ID}/no-such-run/report/", token)[0] == 404

    # The folder page: where the run is, and the TensorBoard command.
    status, _, body = get(f"{run_url}/folder", token)
    assert status == 200, body
    assert f"tensorboard --logdir {layout.tensorboard}" in body.decode() and "report/</a>" in body.decode()

    # The comparison of the sweep the run is part of, from the sweep's folder in the run's bucket.
    assert get(f"{run_url}/sweep/", token)[0] == 404
    write_sweep_report(bucket_dir, run_id, layout.root)
    status, _, body = get(f"{run_url}/sweep/", token)
    assert status == 200 and b"Comparison (baseline: bsp)" in body, body
    status, kind, _ = get(f"{run_url}/sweep/accuracy_and_time.png", token)
    assert (status, kind) == (200, "image/png")


def write_sweep_report(bucket_dir: str, run_id: str, run_dir: str) -> None:
    """What ``syncswitch sweep`` leaves in the bucket for a sweep of this one run."""
    from syncswitch_airflow.tools.compare import RunRef, build_comparison
    from syncswitch_airflow.tools.sweep import SweepProgress

    sweep = SweepLayout.for_sweep(bucket_dir, SWEEP)
    SweepProgress(sweep.progress).record(
        {"label": "bsp", "repeat": 0, "run_id": run_id, "run_dir": run_dir, "state": "success"}
    )
    build_comparison([RunRef("bsp", run_dir)], sweep.root, baseline="bsp")
