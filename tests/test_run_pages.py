"""The plugin's pages without an api-server (syncswitch_airflow.ui.app): which bucket files a page
serves, how a run's sweep is found, what the folder page says. tests/test_report_tab.py drives them
through the real api-server, its auth and a gs:// bucket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from syncswitch.layout import RunLayout, SweepLayout
from syncswitch_airflow.ui.app import Missing, bucket_file, folder_page, sweep_of


def test_a_page_serves_files_below_its_folder_only(tmp_path: Path) -> None:
    layout = RunLayout.for_run(str(tmp_path), "job", "run")
    (tmp_path / "job" / "run" / "report").mkdir(parents=True)
    (tmp_path / "job" / "run" / "report" / "index.html").write_text("<h1>report</h1>")
    (tmp_path / "job" / "run" / "state.json").write_text("{}")
    (tmp_path / "job" / "run" / "report" / "accuracy.png").write_bytes(b"\x89PNG")
    page = bucket_file(layout.report, "index.html", "the report")
    assert (page.status_code, page.media_type, page.body) == (200, "text/html", b"<h1>report</h1>")
    assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")  # no script runs
    assert bucket_file(layout.report, "accuracy.png", "the report").media_type == "image/png"
    for path in ("../state.json", "./index.html", "a//index.html", "..", "x\\..\\state.json"):
        with pytest.raises(Missing, match="is not a file of the report"):
            bucket_file(layout.report, path, "the report")
    for path in ("loss.png", "index.html/x"):  # not there (yet)
        with pytest.raises(Missing, match="the report has no"):
            bucket_file(layout.report, path, "the report")
    with pytest.raises(Missing):  # a folder is no file
        bucket_file(layout.root, "report", "the run")


def test_a_runs_sweep_is_the_one_whose_record_lists_it(tmp_path: Path) -> None:
    bucket = str(tmp_path)
    run = RunLayout.for_run(bucket, "dig-its-bsp", "manual__1")
    other = RunLayout.for_run(bucket, "dig-its-asp", "manual__2")

    def record(name: str, *runs: tuple[str, RunLayout]) -> SweepLayout:
        sweep = SweepLayout.for_sweep(bucket, name)
        Path(sweep.root).mkdir(parents=True, exist_ok=True)
        listed = [{"label": "x", "repeat": 0, "run_id": run_id, "run_dir": lay.root} for run_id, lay in runs]
        Path(sweep.progress).write_text(json.dumps({"runs": listed}))
        return sweep

    with pytest.raises(Missing, match="part of no sweep reported in .*/_sweeps/"):
        sweep_of(run, "manual__1")
    # A sweep named like the job's first word, whose record lists another run only: not this run's.
    record("dig", ("manual__2", other))
    # The same run id in another job's folder is another run.
    record("dig-its", ("manual__1", other), ("manual__2", other))
    with pytest.raises(Missing):
        sweep_of(run, "manual__1")
    sweep = record("dig-its", ("manual__1", run))
    assert sweep_of(run, "manual__1") == sweep


def test_the_folder_page_says_where_the_run_is_and_how_to_open_its_tensorboard_logs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = RunLayout("gs://bucket/runs/job/run")
    sizes = {
        "gs://bucket/runs/job/run/state.json": 10,
        "gs://bucket/runs/job/run/report/index.html": 100,
        "gs://bucket/runs/job/run/report/accuracy.png": 2000,
    }
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    text = folder_page("sync_switch", "manual__<1>", layout, sizes)
    assert "<code>gs://bucket/runs/job/run</code>" in text and "manual__&lt;1&gt;" in text
    assert '<td><a href="report/">report/</a></td><td class=num>2</td><td class=num>2,100</td>' in text
    assert "<td>state.json</td><td class=num>1</td>" in text
    assert "tensorboard --logdir gs://bucket/runs/job/run/tensorboard" in text
    assert "gcloud storage cp -r gs://bucket/runs/job/run/tensorboard tb" in text
    # An emulator's bucket TensorBoard cannot read: the page says to copy it down through our storage.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    text = folder_page("sync_switch", "run", layout, sizes)
    assert "storage.download_dir('gs://bucket/runs/job/run/tensorboard', 'tb')" in text
    local = folder_page("sync_switch", "run", RunLayout("/data/runs/job/run"), {})
    assert "tensorboard --logdir /data/runs/job/run/tensorboard" in local and "Nothing yet" in local
