"""docker-compose.yaml's costs: `up` from cold and warm, the image sizes, and the default run's DAG
time under compose against the embedded default's, side by side.

    .venv/bin/python bench/bench_compose.py              # needs a Docker engine (root: one is started)
    .venv/bin/python bench/bench_compose.py --keep-cache # cold = project images removed, layers cached

Definitions:

    up, cold      `docker compose build` + `up --wait` from no project image and an empty build cache
                  (the stand-in bases kept: they stand for a registry's images), to the UI answering
    up, warm      `docker compose down` (volumes kept) then `up --wait`, images built
    DAG run       the default Trigger's run, trigger -> end in Airflow's record (queued_at -> end_date);
                  compose: the deployment's defaults (2 trainers over SSH); embedded: `syncswitch run`
                  with its defaults (a local cluster), one after the other on the same machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import fmt, log, machine_line, markdown_table, run_json_command, syncswitch_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))
from docker_stack import ComposeStack, DockerEngine, build_stand_ins  # noqa: E402

PROJECT = "syncswitch-bench"
IMAGES = ("syncswitch-airflow:latest", "syncswitch-trainer:latest")


def image_size_gb(tag: str) -> float:
    done = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True, text=True
    )
    return int(done.stdout.strip()) / 1e9 if done.returncode == 0 else float("nan")


def dag_seconds(api: object, run_id: str) -> float:
    run = api.get_json(f"/api/v2/dags/sync_switch/dagRuns/{run_id}")  # type: ignore[attr-defined]
    started = datetime.datetime.fromisoformat(run["queued_at"])
    ended = datetime.datetime.fromisoformat(run["end_date"])
    return (ended - started).total_seconds()


def compose_run(stack: ComposeStack) -> tuple[float, str]:
    api = stack.api()
    run_id = api.trigger("sync_switch", {})
    state = api.wait("sync_switch", run_id, timeout=1800)
    return dag_seconds(api, run_id), state


def embedded_run() -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as home:
        argv = syncswitch_command("run", "--airflow-home", home, "--bucket-dir", f"{home}/runs")
        result = run_json_command(argv, f"{home}.log", timeout=1800)
    return float(result.summary["airflow_run_seconds"]), result.summary["state"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep-cache", action="store_true", help="cold without pruning the build cache")
    args = parser.parse_args()
    engine = DockerEngine.ensure()
    try:
        build_stand_ins()
        for tag in IMAGES:
            subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
        if not args.keep_cache:
            subprocess.run(["docker", "builder", "prune", "-af"], capture_output=True)
        with ComposeStack(PROJECT) as stack:
            log("cold: build + up")
            build = stack.build()
            cold_up = stack.up()
            sizes = {tag: image_size_gb(tag) for tag in IMAGES}
            log("the default run under compose")
            compose_dag, compose_state = compose_run(stack)
            stack.compose("down", "--timeout", "30")  # volumes kept
            log("warm: up")
            warm_up = stack.up()
        log("the default run on the embedded Airflow")
        embedded_dag, embedded_state = embedded_run()
    finally:
        engine.stop()
    print(machine_line())
    print(
        markdown_table(
            ["what", "seconds"],
            [
                ["up, cold: image builds", fmt(build)],
                ["up, cold: up --wait to the UI answering", fmt(cold_up)],
                ["up, cold: total", fmt(build + cold_up)],
                ["up, warm: up --wait to the UI answering", fmt(warm_up)],
            ],
        )
    )
    print(markdown_table(["image", "size (GB)"], [[tag, fmt(size, 2)] for tag, size in sizes.items()]))
    print(
        markdown_table(
            ["default run", "DAG run (s)", "state", "ratio"],
            [
                [
                    "docker compose (2 trainers over SSH)",
                    fmt(compose_dag),
                    compose_state,
                    fmt(compose_dag / embedded_dag, 2),
                ],
                ["embedded (local cluster)", fmt(embedded_dag), embedded_state, "1.00"],
            ],
        )
    )
    print(
        json.dumps(
            {
                "build_s": build,
                "cold_up_s": cold_up,
                "warm_up_s": warm_up,
                "sizes_gb": sizes,
                "compose_dag_s": compose_dag,
                "embedded_dag_s": embedded_dag,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
