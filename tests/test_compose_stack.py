"""docker-compose.yaml for real: the images built, `docker compose up`, the default Trigger trains.

One stack for the file (built once; Docker's layer cache makes a second build of unchanged sources
quick). The run triggered with the DAG's defaults trains on the compose file's trainers over SSH;
meanwhile the Celery worker that ran the segment's task is killed (`docker kill`). The run succeeds,
each segment started once, the report is in the bucket; `docker compose down -v` leaves no container,
network or volume of the project. Skipped, saying why, only where no Docker engine can run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from proc_utils import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

DAG_ID = "sync_switch"


@pytest.fixture(scope="module")
def stack(docker_engine) -> Iterator:  # noqa: ANN001 - docker_stack.DockerEngine
    from docker_stack import ComposeStack, build_stand_ins

    timings = {}
    started = time.monotonic()
    build_stand_ins()
    timings["stand-in bases"] = time.monotonic() - started
    with ComposeStack(f"syncswitch-test-{os.getpid()}") as running:
        timings["build"] = running.build()
        try:
            timings["up"] = running.up()
        except Exception:
            print(running.logs(), flush=True)
            raise
        running.timings = timings
        yield running
    assert running.leftovers() == {"containers": [], "networks": [], "volumes": []}


def segment_task_worker(stack, api, run_id: str) -> dict:  # noqa: ANN001
    """The Celery worker container that ran segment 0's task (a task instance's hostname is its
    container's host name, which is the container id's start)."""
    ti = api.get_json(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/segment_0.bsp")
    workers = stack.containers("airflow-worker")
    [worker] = [c for c in workers if c["ID"].startswith(ti["hostname"]) or ti["hostname"] in c["Name"]]
    return worker


def test_the_default_trigger_trains_through_a_killed_worker_and_down_leaves_nothing(stack) -> None:  # noqa: ANN001
    api = stack.api()
    run_id = api.trigger(DAG_ID, {})  # the Trigger form's defaults: this deployment's
    wait_for(
        lambda: api.task_states(DAG_ID, run_id).get("segment_0.bsp") in ("deferred", "success", "failed"),
        timeout=900,
        what="segment 0 training",
        poll=1.0,
    )
    worker = segment_task_worker(stack, api, run_id)
    subprocess.run(["docker", "kill", worker["ID"]], check=True, capture_output=True, timeout=60)

    state = api.wait(DAG_ID, run_id, timeout=1500)
    if state != "success":
        print(stack.logs("airflow-worker", "triggerer", "scheduler", "trainer"), flush=True)
    assert state == "success", api.task_states(DAG_ID, run_id)

    from syncswitch import storage
    from syncswitch.events import read_events
    from syncswitch.layout import RunLayout

    with pytest.MonkeyPatch.context() as patch:  # the bucket, through the port the stack publishes
        patch.setenv("STORAGE_EMULATOR_HOST", stack.gcs_url)
        layout = RunLayout.for_run("gs://syncswitch-runs/runs", "digits-demo", run_id)
        state_json = storage.read_json(layout.state)
        starts = [e["segment"] for e in read_events(layout.metrics, event="segment_start")]
        report = storage.read_json(f"{layout.report}/summary.json")
    assert state_json["status"] == "success" and state_json["cluster"]["backend"] == "hosts"
    assert sorted(starts) == list(range(len(state_json["plan"]))), starts  # each segment once
    assert report["final_accuracy"] > 0.5
    hosts = {h["address"] for h in state_json["cluster"]["hosts"]}
    trainers = {c["Name"] for c in stack.containers("trainer")}
    assert len(hosts) == 2 and len(trainers) == 3, (hosts, trainers)  # a pool of 3, 2 per run
    print(json.dumps({"timings_s": stack.timings}), flush=True)
