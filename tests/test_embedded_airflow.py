"""The embedded Airflow (supervised components in a project home) and a whole ``syncswitch run``.

The session's one real instance (conftest ``embedded_airflow``) serves these tests, with this project's
dags/ and plugins/ and a private AIRFLOW_HOME under tmp, so it never touches <project>/.airflow or
another test's instance. The CLI runs reuse it (``--airflow-home``) and keep it up (``--keep-ui``); the
fixture stops it at the end of the session and checks the process table.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from airflow_runs import LocalSegmentNodes, segment_starts, task_log
from proc_utils import ProgressThrottle, assert_no_processes, wait_for
from syncswitch.layout import RunLayout
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.embedded.airflow_api import AirflowApi, AirflowError, TriggerRejected
from syncswitch_airflow.embedded.instance import ADMIN_PASSWORD, ADMIN_USER

PROJECT_DIR = Path(__file__).resolve().parents[1]
SYNCSWITCH = Path(sys.executable).parent / "syncswitch"
CONSUMER_DAG = "on_new_model"  # dags/on_new_model.py
GREEDY_BSP_STEPS = 4000

pytestmark = [
    pytest.mark.airflow,
    pytest.mark.skipif(
        not (PROJECT_DIR / "dags" / "sync_switch.py").exists(), reason="needs the sync_switch DAG"
    ),
]


@pytest.fixture
def airflow(embedded_airflow: EmbeddedAirflow) -> EmbeddedAirflow:
    return embedded_airflow


def test_start_serves_the_project_dags_healthy_on_localhost(airflow: EmbeddedAirflow) -> None:
    health = airflow.api.health()
    for component in ("metadatabase", "scheduler", "triggerer", "dag_processor"):
        assert health[component]["status"] == "healthy", health
    assert airflow.url.startswith("http://127.0.0.1:")
    assert airflow.api.import_errors() == []
    assert airflow.api.token()  # the fixed admin password from the password file logs in
    assert airflow.is_running() and airflow.started_here


def test_the_triggerer_builds_its_execution_api_as_it_starts(airflow: EmbeddedAirflow) -> None:
    """Not on the first trigger's first call, beside the first segment's start-up (embedded/triggerer.py)."""
    logs = Path(airflow.home) / "logs" / "components"

    def said_ready() -> bool:  # in the log, or in one rotated since
        return any(
            "execution API ready for the triggers" in f.read_text(errors="replace")
            for f in logs.glob("triggerer.log*")
        )

    wait_for(said_ready, 120, what=f"the triggerer's 'execution API ready' line in {logs}/triggerer.log")


def test_a_second_start_reuses_the_running_instance(airflow: EmbeddedAirflow) -> None:
    again = EmbeddedAirflow(PROJECT_DIR, home=airflow.home)
    again.start(wait_for_dags=("sync_switch",), timeout=120)
    assert not again.started_here
    assert again.running_instance() == airflow.running_instance()
    assert again.url == airflow.url


def test_a_new_instance_waits_for_dags_parsed_since_it_started(airflow: EmbeddedAirflow) -> None:
    """A new instance in a home that served before finds the DAGs of its previous life in the database:
    ready only once its own dag-processor has parsed the files (what the API says of the parse)."""
    import time

    from syncswitch_airflow.embedded import boot

    boot.wait_for_dag(airflow, "sync_switch", time.monotonic() + 30, parsed_after=0.0)
    with pytest.raises(AirflowError, match="did not appear"):
        boot.wait_for_dag(airflow, "sync_switch", time.monotonic() + 1.5, parsed_after=time.time() + 3600)


@pytest.mark.parametrize(
    ("conf", "param"),
    [
        ({"switch_order": 10}, "switch_order"),  # a misspelled one fails validate: test_dag_integrity
        ({"num_workers": 0}, "num_workers"),
        # An unregistered name passes the form (a run's usr_dir may register it): validate rejects it.
        ({"model": ""}, "model"),
    ],
)
def test_rest_trigger_with_invalid_conf_is_rejected_naming_the_param(
    airflow: EmbeddedAirflow, conf: dict, param: str, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    with pytest.raises(TriggerRejected) as rejected:
        airflow.api.trigger("sync_switch", {**conf, "bucket_dir": str(runs)})
    assert param in str(rejected.value)
    assert not runs.exists()  # no run was created, so nothing wrote a run folder


class AnswerDropper:
    """A TCP proxy in front of an HTTP server that passes every request on and relays every answer
    but one: the first answer to a request whose first line starts with ``drop``, which it reads and
    throws away, closing the client's connection, as a network that fails after the server acted."""

    def __init__(self, upstream: str, drop: bytes) -> None:
        self.upstream = urlsplit(upstream)
        self.drop = drop
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                client, _ = self.listener.accept()
                threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection((self.upstream.hostname, self.upstream.port)) as server:
            request = self._read_request(client)
            server.sendall(request)  # urllib asks for "Connection: close": the answer ends the stream
            answer = b"".join(iter(lambda: server.recv(65536), b""))
            if request.startswith(self.drop) and not self.dropped:
                self.dropped += 1
                return
            client.sendall(answer)

    @staticmethod
    def _read_request(client: socket.socket) -> bytes:
        """One whole request: its head, then as many bytes of body as its Content-Length says."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += client.recv(65536)
        body_at = data.index(b"\r\n\r\n") + 4
        fields = data[:body_at].decode("latin-1").lower().splitlines()
        length = next((int(f.split(":", 1)[1]) for f in fields if f.startswith("content-length:")), 0)
        while len(data) - body_at < length:
            data += client.recv(65536)
        return data


def test_a_trigger_whose_answer_was_lost_finds_the_run_it_started(
    airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """The trigger's POST creates the run but its answer never arrives: the client tries again with
    the same run id, is told that id exists, finds its own conf there, and returns that run. One run,
    not two (a retry that started a second run would train the job twice)."""
    proxy = AnswerDropper(airflow.url, drop=b"POST /api/v2/dags/sync_switch/dagRuns ")
    try:
        api = AirflowApi(proxy.url, ADMIN_USER, ADMIN_PASSWORD)
        # An unregistered model passes the form and fails the run's validate task: nothing provisioned.
        conf = {"job_name": "lost-answer", "bucket_dir": str(tmp_path / "runs"), "model": "no_such_model"}
        run_id = api.trigger("sync_switch", conf)
    finally:
        proxy.close()
    assert proxy.dropped == 1
    runs = [r["dag_run_id"] for r in airflow.api.dag_runs("sync_switch") if r["conf"] == conf]
    assert runs == [run_id]
    assert airflow.api.wait("sync_switch", run_id, timeout=300) == "failed"
    assert airflow.api.task_states("sync_switch", run_id)["validate"] == "failed"


def syncswitch_run(
    airflow: EmbeddedAirflow, cwd: Path, *flags: str, timeout: float
) -> tuple[subprocess.CompletedProcess, dict]:
    """`syncswitch run` on this test's Airflow, kept up afterwards; asserts exit 0 and returns the
    completed process and its final JSON line."""
    result = subprocess.run(
        [str(SYNCSWITCH), "run", "--airflow-home", str(airflow.home), "--keep-ui", *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result, json.loads(result.stdout.strip().splitlines()[-1])


def test_syncswitch_run_end_to_end(airflow: EmbeddedAirflow, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    airflow.api.unpause(CONSUMER_DAG)  # the example downstream DAG: paused when created
    try:
        result, summary = syncswitch_run(
            airflow,
            tmp_path,
            *("--bucket-dir", str(runs), "--job-name", "cli-e2e", "--total-steps", "120"),
            *("--cluster-name", "ignored", "--online-policy", "greedy"),
            timeout=900,
        )
        assert_the_new_model_ran_the_downstream_dag(airflow, summary)
    finally:
        airflow.api.pause(CONSUMER_DAG)  # the session's other runs need no consumer
    lines = result.stdout.strip().splitlines()
    assert summary["state"] == "success"
    assert summary["run_id"] and Path(summary["run_dir"]).is_dir()
    assert Path(summary["run_dir"]).parent == runs / "cli-e2e"
    # The default "10" with a 25/75 split of 120 steps.
    assert [(s["protocol"], s["steps"]) for s in summary["segments"]] == [("bsp", 30), ("asp", 90)]
    assert all(s["seconds"] > 0 for s in summary["segments"])
    assert len(summary["switch_gaps_seconds"]) == 1 and summary["switch_gaps_seconds"][0] > 0
    assert 0.5 < summary["final_accuracy"] <= 1.0
    assert summary["total_seconds"] > 0 and summary["online_switches"] == []
    # Airflow's record of the run (queued -> ended) holds its training, and this command, which polls,
    # saw the end no earlier (it started its clock once the trigger had answered: a little later).
    training = sum(s["seconds"] for s in summary["segments"])
    assert training < summary["airflow_run_seconds"] < summary["dag_run_seconds"] + 1.0
    assert Path(summary["report"]).is_file()
    assert_segment_1_was_launched_ahead_of_its_task(airflow, summary)
    # Progress was shown (task states; each segment's training steps, up to its last one), then the
    # report's summary lines. Airflow's and our own event logs went to stderr.
    assert any("segment_0.bsp" in line and line.endswith(": success") for line in lines)
    for segment, target in (("0 BSP", "30/120"), ("1 ASP", "120/120")):
        assert any(f"segment {segment}  ended at step {target}" in line for line in lines), segment
    assert any(line.startswith("final accuracy") for line in lines)
    assert "triggered sync_switch run" in result.stderr and "triggered" not in result.stdout
    assert "--cluster-name is accepted" in result.stderr
    # The report task links to the run's report, bucket folder and TensorBoard logs, as the UI shows:
    # the plugin's pages of the run on the api-server, which serve the local run folder.
    status, links = airflow.api.request(
        "GET", f"/api/v2/dags/sync_switch/dagRuns/{quote(summary['run_id'])}/taskInstances/report/links"
    )
    assert status == 200, links
    run_path = f"/syncswitch/runs/sync_switch/{quote(summary['run_id'], safe='')}"
    assert links["extra_links"] == {
        "Run bucket folder": f"{airflow.url}{run_path}/folder",
        "Run report": f"{airflow.url}{run_path}/report/",
        "TensorBoard logs": f"{airflow.url}{run_path}/folder#tensorboard",
    }
    status, page = airflow.api.request("GET", f"{run_path}/report/")
    assert status == 200 and "syncswitch report: cli-e2e" in page, page
    status, page = airflow.api.request("GET", f"{run_path}/folder")
    assert status == 200 and f"tensorboard --logdir {summary['run_dir']}/tensorboard" in page, page
    # --keep-ui: Airflow is still up and the URL and login were printed.
    assert airflow.is_running() and summary["airflow_url"] == airflow.url
    assert any(airflow.url in line and "password" in line for line in lines)


def assert_segment_1_was_launched_ahead_of_its_task(airflow: EmbeddedAirflow, summary: dict) -> None:
    """Segment 0's trigger launched segment 1; segment 1's task found it running (or ended) and did
    not launch it. Each segment started once."""
    log = task_log(airflow.api, summary["run_id"], "segment_1.asp")
    assert "segment 1 is running; following it" in log or "segment 1 already ended" in log, log[-3000:]
    assert "launched to step" not in log
    assert segment_starts(RunLayout(summary["run_dir"])) == {0: 1, 1: 1}


def assert_the_new_model_ran_the_downstream_dag(airflow: EmbeddedAirflow, summary: dict) -> None:
    """The report task's asset events name the run's report and model; the example DAG scheduled on
    the models alias ran on this one and found its files."""

    def consumer_state() -> str | None:
        runs = airflow.api.dag_runs(CONSUMER_DAG)
        return runs[-1]["state"] if runs else None

    # The consumer's run first: Airflow 3.3's GET /assets/events answers 500 while a run that an event
    # created is queued (its start_date is null, which the response model does not allow).
    wait_for(lambda: consumer_state() in ("success", "failed"), timeout=300, what=f"a {CONSUMER_DAG} run")
    assert consumer_state() == "success"
    query = f"source_dag_id=sync_switch&source_run_id={quote(summary['run_id'])}"
    events = airflow.api.get_json(f"/api/v2/assets/events?{query}")["asset_events"]
    by_uri = {e["uri"]: e["extra"] for e in events}
    assert set(by_uri) == {"syncswitch://cli-e2e/model", "syncswitch://cli-e2e/report"}, events
    model = by_uri["syncswitch://cli-e2e/model"]
    assert model["run_id"] == summary["run_id"] and model["run_dir"] == summary["run_dir"]
    assert model["saved_model"] == f"{summary['run_dir']}/export/saved_model"
    assert model["test_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert by_uri["syncswitch://cli-e2e/report"]["report"] == summary["report"]
    assert [run["dag_id"] for e in events for run in e["created_dagruns"]] == [CONSUMER_DAG]


def test_greedy_switches_to_asp_and_back_around_a_transient_straggler(
    airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """Issue 4 end to end on the real scheduler: worker 1 of the BSP segment runs 4x slower until
    greedy has decided to switch. The sensor beside the BSP segment raises, greedy switches to ASP;
    the ASP segment runs clean, so greedy switches back to BSP for the rest of the BSP budget; then the
    planned ASP segment runs. The workload stays exact and teardown leaves nothing running."""
    runs = tmp_path / "runs"

    def decided(action: str) -> bool:
        states = (json.loads(p.read_text()) for p in runs.glob("greedy-e2e/*/state.json"))
        return any(d["action"] == action for state in states for d in state.get("decisions", []))

    def asp_nodes_once_stepping() -> list[int]:
        started = any(p.stat().st_size for p in runs.glob("greedy-e2e/*/metrics/seg-01-asp/chief-0.jsonl"))
        return asp_nodes() if started else []

    # Tied to progress, not to the clock (a --straggler episode is timed from the segment's start, and
    # on a slow machine it could end before the first step): worker 1 of the BSP segment runs at a
    # quarter speed until greedy has switched. Greedy then switches back after 3 clean 5 s windows of
    # ASP (+ lateness, + the sensor's resume), ~20 s that unthrottled ASP would fill with thousands of
    # steps, more than the BSP budget has left on a fast machine: so the whole ASP segment runs at a
    # sixteenth of its speed, every node at once (no worker looks slower than another), until greedy
    # has switched back. The rest of the BSP budget then trains as BSP.
    asp_nodes = LocalSegmentNodes("greedy-e2e", 1)
    straggler = ProgressThrottle(LocalSegmentNodes("greedy-e2e", 0, "worker-1"), lambda: decided("switch"))
    asp_brake = ProgressThrottle(asp_nodes_once_stepping, lambda: decided("switch_back"), slowdown=16)
    with straggler, asp_brake:
        _result, summary = syncswitch_run(
            airflow,
            tmp_path,
            *("--bucket-dir", str(runs), "--job-name", "greedy-e2e", "--switch-order", "10"),
            *("--train-steps", f"{GREEDY_BSP_STEPS}", "100", "--ckpt-frequency", "500"),
            *("--online-policy", "greedy"),
            timeout=1500,
        )
    assert straggler.slowed, "the first BSP segment's worker 1 was never found"
    assert asp_brake.slowed, "the ASP segment's nodes were never found"
    actions = [d["action"] for d in summary["online_switches"]]
    assert actions[:2] == ["switch", "switch_back"], summary["online_switches"]
    assert all(d["reason"] for d in summary["online_switches"])
    protocols = [s["protocol"] for s in summary["segments"]]
    assert protocols == ["bsp", "asp", "bsp", "asp"], summary["segments"]
    total = GREEDY_BSP_STEPS + 100
    assert sum(s["steps"] for s in summary["segments"]) == total, "the workload must stay exact"
    state = json.loads((Path(summary["run_dir"]) / "state.json").read_text())
    assert [e["origin"] for e in state["plan"]] == ["plan", "online", "online", "plan"]
    assert state["plan"][-1]["until_step"] == total
    assert state["decisions"][0]["workers"] == [1]
    assert_no_processes("greedy-e2e.*syncswitch|syncswitch.*greedy-e2e", timeout=30)
