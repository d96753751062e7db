"""Soak benchmark (issue 7): a long job under the DAG, with memory and disk sampled every minute.

    .venv/bin/python bench/bench_soak.py                               # ~70 minutes on 2 cores
    .venv/bin/python bench/bench_soak.py --bsp-steps 100 --asp-steps 200 --sample-seconds 10  # smoke

One `sync_switch` run, switch order "10": ResNet-20 on synthetic CIFAR, 32 examples per worker, a BSP
segment of --bsp-steps then an ASP segment of --asp-steps (the defaults take 30+ minutes each on 2
cores: bench_runtime measured 118 examples/s BSP and 223 ASP for this model, 64 examples a step),
checkpoints every --ckpt-frequency steps, on its own embedded Airflow. Every --sample-seconds it
records:

    rss            resident memory of every process of the training cluster (by the cluster marker)
                   and of the embedded Airflow (by its instance marker), grouped by role
    files          bytes of the run's event files, state.json, checkpoint folder, and the Airflow task
                   logs of the run

and prints, per group, the first and last sample, the minimum and maximum, and the growth per hour
fitted over the second half of each segment (so start-up and the first trace do not count). "Flat"
here means: no steady upward trend (the per-hour slope over the second half of a segment is small next
to the level); what it measured is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BenchError, fmt, log, machine_line, markdown_table
from background import Poller

PROJECT_DIR = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def folder_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file()) if path.exists() else 0


class Sampler(Poller):
    """Samples memory and disk in a thread until stopped."""

    def __init__(self, airflow: Any, runs_root: Path, every: float, out: Path | None = None) -> None:
        self.airflow, self.runs_root, self.every, self.out = airflow, runs_root, every, out
        self.samples: list[dict[str, Any]] = []
        super().__init__(every=every, join_seconds=None)

    def poll(self) -> None:
        try:
            sample = self.sample()
            self.samples.append(sample)
            if self.out is not None:  # as it goes: a soak cut short still leaves its samples
                with self.out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(sample) + "\n")
        except Exception as exc:  # noqa: BLE001 - a sample lost is not the benchmark lost
            log(f"sample failed: {exc}")

    def sample(self) -> dict[str, Any]:
        from syncswitch import procs
        from syncswitch_airflow.backends.base import CLUSTER_ENV
        from syncswitch_airflow.embedded.instance import INSTANCE_ENV, instance_marker

        groups: dict[str, float] = {}
        training: dict[str, float] = {}
        marker = instance_marker(self.airflow.running_instance())
        for proc in procs.processes_with_env(INSTANCE_ENV, marker):
            groups["airflow"] = groups.get("airflow", 0.0) + rss_mb(proc.pid)
        cluster_dirs = self._cluster_dirs()
        for proc in procs.live_processes():
            if any(procs.has_env(proc.pid, CLUSTER_ENV, d) for d in cluster_dirs):
                training[process_label(proc)] = rss_mb(proc.pid)
        groups["training"] = sum(training.values())
        run_dirs = [p for p in self.runs_root.glob("soak/*") if p.is_dir()]
        run = run_dirs[0] if run_dirs else None
        logs = Path(self.airflow.home) / "logs"
        return {
            "time": time.time(),
            "rss_mb": groups,
            "training_rss_mb": training,
            "bytes": {
                "events": folder_bytes(run / "metrics", "**/*.jsonl") if run else 0,
                "state.json": (run / "state.json").stat().st_size
                if run and (run / "state.json").exists()
                else 0,
                "checkpoints": folder_bytes(run / "checkpoints") if run else 0,
                "task logs": folder_bytes(logs / "dag_id=sync_switch"),
                "component logs": folder_bytes(logs / "components"),
            },
            "segment": current_segment(run) if run else None,
        }

    def _cluster_dirs(self) -> list[str]:
        root = Path(os.environ.get("SYNCSWITCH_WORK_DIR") or Path(tempfile.gettempdir()) / "syncswitch")
        return [str(p) for p in root.glob("soak-*") if p.is_dir()]


def process_label(proc: Any) -> str:
    """What a training process is, and its pid: the fork server, a node forked from it (TF_CONFIG is
    set after the fork, so a node's command line is its fork server's), or the command it runs."""
    try:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = []
    command = " ".join(a.decode(errors="replace") for a in argv[1:4])
    if "syncswitch.forkserver" in command:
        parent = Path(f"/proc/{proc.ppid}/cmdline")
        forked = parent.exists() and b"syncswitch.forkserver" in parent.read_bytes()
        return f"{'node' if forked else 'fork server'} {proc.pid}"
    return f"{command.split('/')[-1][:40]} {proc.pid}"


def current_segment(run: Path) -> str | None:
    state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {}
    done = set(state.get("segments", {}))
    for entry in state.get("plan", []):
        if str(entry["index"]) not in done:
            return f"{entry['index']} {entry['protocol']}"
    return None


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of value over time, per hour."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return None if var == 0 else 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def series_rows(samples: list[dict[str, Any]], kind: str, unit_scale: float, digits: int) -> list[list[Any]]:
    names = sorted({name for s in samples for name in s[kind]})
    rows = []
    for name in names:
        values = [(s["time"], s[kind][name] / unit_scale, s["segment"]) for s in samples if name in s[kind]]
        level = [v for _t, v, _s in values]
        slopes = []
        for segment in sorted({seg for _t, _v, seg in values if seg}):
            part = [(t, v) for t, v, seg in values if seg == segment]
            slopes.append(f"{segment}: {fmt(slope_per_hour(part[len(part) // 2 :]), digits)}")
        rows.append(
            [
                name,
                fmt(level[0], digits),
                fmt(level[-1], digits),
                fmt(min(level), digits),
                fmt(max(level), digits),
                "; ".join(slopes),
            ]
        )
    return rows


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bsp-steps", type=int, default=3600)
    p.add_argument("--asp-steps", type=int, default=6600)
    p.add_argument("--ckpt-frequency", type=int, default=300)
    p.add_argument("--sample-seconds", type=float, default=60.0)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--samples-out", type=Path, help="append each sample to this JSONL file as it is taken")
    args = p.parse_args(argv)
    from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
    from syncswitch_airflow.report import load_run, summarize

    # SIGTERM unwinds like Ctrl-C, so the embedded Airflow and the run's cluster are stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    machine = machine_line()
    airflow = EmbeddedAirflow(PROJECT_DIR, home=work / "airflow", port=0)
    conf = {
        "job_name": "soak",
        "bucket_dir": str(work / "runs"),
        "switch_order": "10",
        "train_steps": [args.bsp_steps, args.asp_steps],
        "ckpt_frequency": [args.ckpt_frequency],
        "model": "resnet",
        "hparam_set": "resnet_cifar_20",
        "problem": "synthetic_cifar",
        "hparams": ["batch_size=32"],
    }
    try:
        airflow.start(wait_for_dags=("sync_switch",))
        with Sampler(airflow, work / "runs", args.sample_seconds, args.samples_out) as sampler:
            run_id = airflow.api.trigger("sync_switch", conf)
            log(f"soak run {run_id}: BSP {args.bsp_steps} + ASP {args.asp_steps} steps")
            state = airflow.api.wait("sync_switch", run_id, timeout=6 * 3600)
        if state != "success":
            raise BenchError(f"the soak run ended {state}")
        run_dir = next((work / "runs" / "soak").iterdir())
        summary = summarize(load_run(str(run_dir)))
    except BenchError as exc:
        print(f"bench_soak: {exc}", file=sys.stderr)
        return 1
    finally:
        airflow.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("# bench_soak: one sync_switch run, ResNet-20 synthetic CIFAR, '10'")
    print(f"machine: {machine}")
    print()
    rows = [
        [
            s["index"],
            s["protocol"],
            fmt(s.get("steps"), 0),
            fmt((s.get("seconds") or 0) / 60, 1),
            fmt(s.get("examples_per_sec"), 0),
        ]
        for s in summary["segments"]
    ]
    print(markdown_table(["segment", "protocol", "steps", "minutes", "examples/s"], rows))
    print(
        f"run: {summary.get('status')}, final accuracy {fmt(summary.get('final_accuracy'), 4)}, "
        f"{len(sampler.samples)} samples every {args.sample_seconds:.0f} s"
    )
    series = [
        ("resident memory (MB): first, last, min, max; slope MB/hour over the second half of each segment",
         "group", "rss_mb", 1.0, "slope per hour"),
        ("training processes' resident memory (MB), each while it lived",
         "process", "training_rss_mb", 1.0, "slope per hour"),
        ("files (kB): first, last, min, max; growth kB/hour over the second half of each segment",
         "what", "bytes", 1024.0, "growth per hour"),
    ]  # fmt: skip
    for title, label, kind, scale, trend in series:
        print()
        print(title)
        print()
        print(
            markdown_table(
                [label, "first", "last", "min", "max", trend], series_rows(sampler.samples, kind, scale, 0)
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
