"""How much of the machine the embedded Airflow takes, and what that costs in switch gaps (issue 7).

    .venv/bin/python bench/bench_airflow_cpu.py                 # ~15 minutes on 2 cores
    .venv/bin/python bench/bench_airflow_cpu.py --only "before,now" --samples 3 --sample-seconds 60 \
        --first-segment-steps 16000
    .venv/bin/python bench/bench_airflow_cpu.py --only "metrics" --rounds 2    # metrics on and off

The metrics settings (issue 59) send Airflow's StatsD to a sink this script listens on (metrics.md);
"metrics off" is the instance as it ships. Their rows also count the StatsD datagrams received while
BSP trains, all and the pipeline's (``syncswitch.``). ``--rounds`` measures the chosen settings that
many times, alternating, so a busy machine's drift falls on each alike.

For each setting, side by side in one run: a fresh embedded Airflow (its own home), its CPU use idle
for ``--sample-seconds``, then a digits job on it ("101010": a long first BSP segment, then short
ones), its CPU use while the BSP segment trains (the mean of ``--samples`` samples), and the job's
five switch gaps. CPU use is user+system time from /proc of every process of the instance (they carry
its marker), grouped by component (the supervisor; scheduler, dag-processor, triggerer, api-server with
everything they started), in cores (1.0 = one core busy). Goal: at most 0.05 cores while a segment
trains, without a longer switch gap. Beside the gaps, the run's fixed overhead: trigger -> first
step, and the last segment's end -> run finished (evaluate, report, teardown, finalize).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BenchError, fmt, log, machine_line, markdown_table, wait_for_bsp_step

PROJECT_DIR = Path(__file__).resolve().parents[1]
GOAL_CORES = 0.05
# The scheduler timers the embedded Airflow relaxes (embedded.py), at Airflow's defaults.
AIRFLOW_TIMERS = {
    "SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "15",
    "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "10",
    "SCHEDULER__PARSING_CLEANUP_INTERVAL": "60",
    "CONNECTION_TEST__REAPER_INTERVAL": "30",
}
COLD_EXECUTOR = {"CORE__EXECUTOR": "LocalExecutor", "SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "2.0"}
# StatsD to the sink this script opens (its port is filled in at the start of a measurement).
STATSD_PORT = "{statsd_port}"
STATSD = {
    "METRICS__STATSD_ON": "True",
    "METRICS__STATSD_HOST": "127.0.0.1",
    "METRICS__STATSD_PORT": STATSD_PORT,
    "METRICS__STATSD_INFLUXDB_ENABLED": "True",
}
SETTINGS = {
    "idle sleep 0.1 s, Airflow's timers (Airflow's defaults)": {
        **COLD_EXECUTOR,
        "SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.1",
        **AIRFLOW_TIMERS,
    },
    "idle sleep 2 s, Airflow's timers": {**COLD_EXECUTOR, **AIRFLOW_TIMERS},
    "idle sleep 2 s, relaxed timers, cold task starts (LocalExecutor)": COLD_EXECUTOR,
    # The WarmLocalExecutor: warm task starts, and a heartbeat that waits up to 4.8 s for a task to
    # end, then a 0.2 s idle sleep (warm_start.py, instance.py).
    "5 s loop, relaxed timers, warm task starts that follow each other at once (now)": {},
    "metrics off (as shipped)": {},
    "metrics on: StatsD, Airflow's and the pipeline's": STATSD,
    "metrics on: StatsD, the pipeline's alone (metrics_allow_list = syncswitch)": {
        **STATSD,
        "METRICS__METRICS_ALLOW_LIST": "syncswitch",
    },
}
# A long first BSP segment to sample in, then five short segments: five switch gaps per setting.
SWITCH_ORDER = "101010"
SHORT_SEGMENT_STEPS = 300
COMPONENTS = ("supervisor", "scheduler", "dag-processor", "triggerer", "api-server")


def component_of(pid: int, roots: dict[int, str]) -> str:
    from syncswitch import procs

    for _ in range(16):
        if pid in roots:
            return roots[pid]
        stat = procs.read_stat(pid)
        if stat is None or stat.ppid <= 1:
            return "other"
        pid = stat.ppid
    return "other"


def cpu_by_component(airflow: Any, seconds: float) -> dict[str, float]:
    """Cores used by each component over ``seconds`` (processes that start or end meanwhile count
    for the part they were seen in)."""
    from syncswitch import procs
    from syncswitch_airflow.embedded.instance import INSTANCE_ENV, instance_marker
    from syncswitch_airflow.embedded.supervisor import read_status

    marker = instance_marker(airflow.running_instance())

    def sample() -> dict[int, float]:
        return {
            p.pid: procs.cpu_seconds(p.pid) or 0.0 for p in procs.processes_with_env(INSTANCE_ENV, marker)
        }

    status = read_status(Path(airflow.home)) or {}
    roots = {c["pid"]: name for name, c in status.get("components", {}).items() if c.get("pid")}
    roots[status.get("pid", -1)] = "supervisor"
    before, started = sample(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = sample(), time.monotonic() - started
    used: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
    for pid, cpu in after.items():
        name = component_of(pid, roots)
        used[name] = used.get(name, 0.0) + (cpu - before.get(pid, 0.0)) / elapsed
    return used


def measure(name: str, settings: dict[str, str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from statsd_sink import StatsdSink

    with StatsdSink() as sink:
        filled = {key: value.replace(STATSD_PORT, str(sink.port)) for key, value in settings.items()}
        return measure_with(name, filled, args, work, sink)


def datagrams_while(sink: Any, seconds: float, call: Any) -> tuple[Any, dict[str, float]]:
    """``call()``'s result (it lasts about ``seconds``), and the StatsD datagrams and the pipeline's
    samples received meanwhile, per second."""
    datagrams, ours = sink.datagrams, len(sink.received("airflow.syncswitch."))
    started = time.monotonic()
    value = call()
    elapsed = max(time.monotonic() - started, seconds, 1e-9)
    counts = {
        "datagrams": (sink.datagrams - datagrams) / elapsed,
        "syncswitch": (len(sink.received("airflow.syncswitch.")) - ours) / elapsed,
    }
    return value, counts


def measure_with(
    name: str, settings: dict[str, str], args: argparse.Namespace, work: Path, sink: Any
) -> dict[str, Any]:
    from syncswitch.layout import RunLayout
    from syncswitch.state import read_state
    from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
    from syncswitch_airflow.report import load_run, summarize

    airflow = EmbeddedAirflow(PROJECT_DIR, home=work / "airflow", port=0, settings=settings)
    try:
        log(f"{name}: starting the embedded Airflow")
        airflow.start(wait_for_dags=("sync_switch",))
        time.sleep(10)  # let the start-up parse and reserialize settle
        log(f"{name}: sampling idle CPU for {args.sample_seconds:.0f} s")
        idle = cpu_by_component(airflow, args.sample_seconds)
        conf = {
            "job_name": "cpu",
            "bucket_dir": str(work / "runs"),
            "switch_order": SWITCH_ORDER,
            "train_steps": [args.first_segment_steps] + [SHORT_SEGMENT_STEPS] * (len(SWITCH_ORDER) - 1),
            "max_online_switches": 0,
            "ckpt_frequency": [500],
        }
        triggered_at = time.time()
        run_id = airflow.api.trigger("sync_switch", conf)
        layout = RunLayout.for_run(conf["bucket_dir"], "cpu", run_id)
        wait_for_bsp_step(layout, 100)
        log(f"{name}: sampling CPU for {args.samples} x {args.sample_seconds:.0f} s while BSP trains")
        samples, rates = [], []
        for index in range(args.samples):
            sample, rate = datagrams_while(
                sink, args.sample_seconds, lambda: cpu_by_component(airflow, args.sample_seconds)
            )
            samples.append(sample)
            rates.append(rate)
            parts = ", ".join(f"{c} {v:.3f}" for c, v in samples[-1].items() if v >= 0.0005)
            log(f"{name}: sample {index + 1}: {sum(samples[-1].values()):.3f} cores ({parts})")
        seen = {name for sample in samples for name in sample}  # "other" too, as the totals count it
        training = {c: sum(s.get(c, 0.0) for s in samples) / len(samples) for c in seen}
        sampled_until = time.time()
        state = airflow.api.wait("sync_switch", run_id, timeout=3600)
        if state != "success":
            raise BenchError(f"{name}: the run ended {state}")
        summary = summarize(load_run(layout.root))
        bsp_end = summary["segments"][0].get("ended_at") or 0.0
        if bsp_end < sampled_until:
            raise BenchError(f"{name}: the BSP segment ended inside the sample; raise --first-segment-steps")
        gaps = [g["seconds"] for g in summary["switch_gaps_seconds"] if g.get("seconds") is not None]
        totals = [sum(s.values()) for s in samples]
        # The run's fixed overhead: trigger -> first step, last segment's end -> run finished.
        finished = (read_state(layout) or {}).get("timings", {}).get("finished")
        start_up = summary["segments"][0]["first_step_at"] - triggered_at
        wind_down = finished - summary["segments"][-1]["ended_at"] if finished else None
        return {
            "idle": idle,
            "training": training,
            "totals": totals,
            "gaps": gaps,
            "start_up": start_up,
            "wind_down": wind_down,
            "datagrams": sum(r["datagrams"] for r in rates) / len(rates),
            "syncswitch": sum(r["syncswitch"] for r in rates) / len(rates),
            "syncswitch_total": len(sink.received("airflow.syncswitch.")),
        }
    finally:
        airflow.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample-seconds", type=float, default=45.0)
    p.add_argument("--samples", type=int, default=1, help="samples while BSP trains (their mean is shown)")
    p.add_argument("--first-segment-steps", type=int, default=6000, help="the BSP segment sampled in")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="measure the chosen settings this many times")
    p.add_argument(
        "--only",
        default="",
        help="measure only the settings whose name contains one of these comma-separated texts",
    )
    args = p.parse_args(argv)
    machine = machine_line()
    results: dict[str, dict[str, Any]] = {}
    work_root = Path(tempfile.mkdtemp(prefix="bench-airflow-cpu-"))
    chosen = [(n, s) for n, s in SETTINGS.items() if any(text.strip() in n for text in args.only.split(","))]
    try:
        for round_index in range(args.rounds):
            for index, (name, settings) in enumerate(chosen):
                label = f"{name}, round {round_index + 1}" if args.rounds > 1 else name
                results[label] = measure(label, settings, args, work_root / f"{round_index}-{index}")
    except BenchError as exc:
        print(f"bench_airflow_cpu: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work_root, ignore_errors=True)
    print(f"# bench_airflow_cpu: embedded Airflow CPU use (cores), {args.sample_seconds:.0f} s samples")
    print(f"machine: {machine}")
    print()
    headers = ["setting", "phase", *COMPONENTS, "total", f"<= {GOAL_CORES}", "each sample"]
    rows = []
    for name, result in results.items():
        for phase in ("idle", "training"):
            used = result[phase]
            total = sum(used.values())
            label = "idle" if phase == "idle" else "while BSP trains"
            each = [total] if phase == "idle" else result["totals"]
            rows.append(
                [
                    name,
                    label,
                    *(fmt(used.get(c, 0.0), 3) for c in COMPONENTS),
                    fmt(total, 3),
                    "yes" if total <= GOAL_CORES else "NO",
                    " ".join(fmt(t, 3) for t in each),
                ]
            )
    print(markdown_table(headers, rows))
    print()
    print(
        markdown_table(
            [
                "setting",
                "switch gaps (s)",
                "mean gap (s)",
                "trigger -> first step (s)",
                "last segment end -> run finished (s)",
            ],
            [
                [
                    n,
                    " ".join(fmt(g, 1) for g in r["gaps"]),
                    fmt(sum(r["gaps"]) / len(r["gaps"]), 1) if r["gaps"] else "-",
                    fmt(r["start_up"], 1),
                    fmt(r["wind_down"], 1) if r["wind_down"] is not None else "-",
                ]
                for n, r in results.items()
            ],
        )
    )
    print()
    print(
        markdown_table(
            [
                "setting",
                "StatsD datagrams/s while BSP trains",
                "the pipeline's samples/s then",
                "the pipeline's samples in the run",
            ],
            [
                [n, fmt(r["datagrams"], 2), fmt(r["syncswitch"], 2), str(r["syncswitch_total"])]
                for n, r in results.items()
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
