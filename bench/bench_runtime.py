"""Runtime benchmark (issue 2): single-process baseline vs BSP / ASP local clusters, with and without a
straggler, side by side in one run.

    .venv/bin/python bench/bench_runtime.py                 # ~6-10 minutes on 2 cores
    .venv/bin/python bench/bench_runtime.py --quick         # smoke test: a few steps per config
    .venv/bin/python bench/bench_runtime.py --pin-cores     # also every cluster config with pinned cores
    .venv/bin/python bench/bench_runtime.py --steady-state  # ASP / BSP at 2 and 8 workers, digits and
                                                            # ResNet-20, segments long enough that the
                                                            # warm-up is under 10 % of each

Every config trains ResNet-20 (``resnet_cifar_20``) on ``synthetic_cifar`` with 32 examples per worker
per step, on the same number of examples (``--steps`` BSP-equivalent steps of 2 x 32 examples):

    baseline         one process, a Keras custom training loop (GradientTape + tf.function) with the same
                     model, loss, optimizer and per-step batch; TF's default threads (all cores)
    bsp              `syncswitch train --protocol bsp --workers 2` (MultiWorkerMirroredStrategy)
    asp              `syncswitch train --protocol asp --ps 1 --workers 2` (ParameterServerStrategy)
    * + straggler    worker 1 runs 1/--slowdown of the time for the whole run (SIGSTOP/SIGCONT duty cycle)

examples/s is the steady-state rate after warm-up: for the clusters from the chief's ``step`` events
(skipping the first --warmup fraction of the samples), for the baseline over the steps after it.
"start -> 1st step" is process launch to the end of the first training step (TF import, cluster
connect, model build/restore, first step with its tracing). The baseline runs first and again last, so
drift of the shared machine's load shows; ratios are to the mean of the two baseline runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from _common import (
    BenchError,
    fmt,
    load_1m,
    log,
    machine_line,
    markdown_table,
    run_json_command,
    syncswitch_command,
)

HPARAM_SET = "resnet_cifar_20"
PROBLEM = "synthetic_cifar"
WORKERS = 2
BATCH_PER_WORKER = 32
GOAL_RATIO = 0.8
STRAGGLER_FOREVER_SECONDS = 86_400
LAUNCH_TIME_ENV = "BENCH_LAUNCH_TIME"
STARTUP_PARTS = ("process_start", "cluster_connect", "restore", "first_step")
DIGITS_STEPS_MULTIPLE = 20
TARGET_ACCURACY = 0.97
TTA_STEPS = 300  # digits from scratch, evaluated every TTA_CHECKPOINT_STEPS steps
TTA_CHECKPOINT_STEPS = 10


@dataclass(frozen=True)
class Config:
    name: str
    protocol: str | None  # None: the single-process baseline
    straggler: bool = False
    pin_cores: bool = False
    model: str = "resnet"  # "resnet": ResNet-20 on synthetic CIFAR; "digits": the digits CNN
    workers: int = WORKERS
    time_to_accuracy: bool = False  # evaluate every few steps and time the way to TARGET_ACCURACY

    @property
    def is_baseline(self) -> bool:
        return self.protocol is None


@dataclass
class Measurement:
    config: Config
    examples_per_sec: float | None = None  # steady state, after warm-up
    segment_examples_per_sec: float | None = None  # all examples over the training seconds
    training_seconds: float | None = None
    wall_seconds: float | None = None
    startup: dict[str, float] = field(default_factory=dict)
    before_launch: float | None = None  # command start -> processes launched (CLI import, preflight)
    after_end: float | None = None  # segment end -> command exited (process exit, cluster stop)
    load_at_start: float = 0.0
    error: str | None = None
    closure_timing: dict[str, float] = field(default_factory=dict)  # ASP only
    seconds_to_target: float | None = None  # time_to_accuracy configs: training seconds to the target

    @property
    def startup_seconds(self) -> float | None:
        return sum(self.startup.values()) if self.startup else None


# ---- the configs ---------------------------------------------------------------------------------


def configs(pin_cores: bool) -> list[Config]:
    clusters = [
        Config("BSP 2 workers", "bsp"),
        Config("ASP 1 PS + 2 workers", "asp"),
        Config("BSP 2 workers, straggler", "bsp", straggler=True),
        Config("ASP 1 PS + 2 workers, straggler", "asp", straggler=True),
        Config("digits BSP 2 workers", "bsp", model="digits"),
        Config("digits ASP 1 PS + 2 workers", "asp", model="digits"),
        Config("digits BSP 2 workers, to 0.97", "bsp", model="digits", time_to_accuracy=True),
        Config("digits ASP 1 PS + 2 workers, to 0.97", "asp", model="digits", time_to_accuracy=True),
    ]
    if pin_cores:
        clusters += [
            Config(f"{c.name}, pinned", c.protocol, straggler=c.straggler, pin_cores=True) for c in clusters
        ]
    return [Config("baseline (1 process)", None), *clusters, Config("baseline (again)", None)]


def steady_state_configs() -> list[Config]:
    """BSP and ASP side by side for each model at 2 and 8 workers (issue 18: what a long job sees)."""
    return [
        Config(f"{label} {name} {workers} workers", protocol, model=model, workers=workers)
        for model, label in (("digits", "digits"), ("resnet", "ResNet-20"))
        for workers in (2, 8)
        for protocol, name in (("bsp", "BSP"), ("asp", "ASP 1 PS +"))
    ]


# ---- the single-process baseline (runs in a child process) ---------------------------------------


BASELINE_STEPS_PER_CALL = 16


def baseline_child(steps: int, warmup: float, intra_op_threads: int) -> dict[str, Any]:
    """Train in this process and return the measurement; run via --baseline-child by the parent."""
    launched = float(os.environ.get(LAUNCH_TIME_ENV, time.time()))
    import tensorflow as tf

    if intra_op_threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    imported = time.time()

    from syncswitch.hparams import get_hparams, learning_rate_at
    from syncswitch.models import build_model, decayed_weights, example_loss
    from syncswitch.optim import StepConfig
    from syncswitch.params import FlatModel
    from syncswitch.problems import get_problem

    hp = get_hparams(HPARAM_SET).override(f"batch_size={BATCH_PER_WORKER}")
    problem = get_problem(PROBLEM)
    model = build_model(hp, problem)
    # The training step of the clusters (flat weights, fused momentum update), in one process.
    flat = FlatModel(model, groups=1, hp=hp, decayed=decayed_weights(model))
    dataset = problem.train_dataset("", batch_size=hp.batch_size, shard_index=0, num_shards=1, seed=0)
    iterator = iter(dataset)
    per_example_loss = example_loss(problem, model)
    built = time.time()

    @tf.function
    def train_steps(lrs: Any, momentum: Any) -> Any:
        # Several steps per call, as the clusters run them (steps_per_execution).
        loss = tf.constant(0.0)
        for j in tf.range(tf.shape(lrs)[0]):
            x, y = next(iterator)
            loss, grads, statistics = flat.loss_and_gradients(
                x, y, lambda outputs, labels: tf.reduce_mean(per_example_loss(outputs, labels))
            )
            flat.apply(grads, statistics, StepConfig(lrs[j], momentum))
        return loss

    # The same examples as the clusters: `steps` global batches of WORKERS x 32, here 32 at a time.
    batches = steps * WORKERS
    warm_batches = min(max(int(batches * warmup), 1), batches - 1)
    times: list[float] = []
    losses: list[float] = []
    done = 0
    while done < batches:
        # Calls end exactly at the warm-up boundary, where the steady-state timing starts.
        count = min(BASELINE_STEPS_PER_CALL, (warm_batches if done < warm_batches else batches) - done)
        # Linear LR scaling for a 32-example step, as the configuration policy does for ASP.
        lrs = [learning_rate_at(hp, (done + j) / WORKERS, steps) / WORKERS for j in range(count)]
        loss = train_steps(tf.constant(lrs, tf.float32), tf.constant(hp.optimizer_momentum_momentum))
        losses.append(float(loss))  # float() waits for the steps, as the clusters' loops do
        done += count
        times.extend([time.time()] * count)
    steady = (batches - warm_batches) * BATCH_PER_WORKER / (times[-1] - times[warm_batches - 1])
    seconds = times[-1] - times[0]
    return {
        "ended_at": times[-1],
        "examples_per_sec": steady,
        "segment_examples_per_sec": batches * BATCH_PER_WORKER / seconds,
        "training_seconds": seconds,
        "startup": {
            "process_start": imported - launched,
            "restore": built - imported,  # model and optimizer build (nothing to restore)
            "first_step": times[0] - built,
        },
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def measure_baseline(config: Config, args: argparse.Namespace, work_dir: str) -> Measurement:
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--baseline-child",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--baseline-intra-op-threads={args.baseline_intra_op_threads}",
    ]
    log_path = os.path.join(work_dir, f"{slug(config.name)}.log")
    env = {LAUNCH_TIME_ENV: repr(time.time()), "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = run_json_command(argv, log_path, timeout=args.config_timeout, env=env)
    exited = time.time()
    s = result.summary
    log(f"{config.name}: loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}")
    return Measurement(
        config,
        examples_per_sec=s["examples_per_sec"],
        segment_examples_per_sec=s["segment_examples_per_sec"],
        training_seconds=s["training_seconds"],
        wall_seconds=result.wall_seconds,
        startup=s["startup"],
        before_launch=0.0,  # the launch time is taken when the child is started
        after_end=exited - s["ended_at"],
    )


# ---- the clusters ----------------------------------------------------------------------------------


def cluster_argv(config: Config, args: argparse.Namespace, run_dir: str) -> list[str]:
    if config.time_to_accuracy:
        steps = TTA_STEPS
        model = ["--problem=digits", "--model=cnn", "--hparam-set=cnn_digits"]
    elif config.model == "digits":
        # The demo job's model: the same number of examples as ResNet-20's runs take seconds here.
        steps = args.steps * DIGITS_STEPS_MULTIPLE
        model = ["--problem=digits", "--model=cnn", "--hparam-set=cnn_digits"]
    else:
        steps = args.steps
        model = [f"--problem={PROBLEM}", "--model=resnet", f"--hparam-set={HPARAM_SET}"]
    # The same examples at any cluster size: fewer global steps of a larger global batch.
    steps = max(steps * WORKERS // config.workers, 10)
    argv = syncswitch_command(
        "train",
        f"--protocol={config.protocol}",
        f"--workers={config.workers}",
        "--ps=1",
        *model,
        f"--hparams=batch_size={BATCH_PER_WORKER}",
        f"--run-dir={run_dir}",
        f"--until-step={steps}",
        f"--total-steps={steps}",
        # A checkpoint at the end only: the benchmark times training. Time-to-accuracy configs
        # evaluate every checkpoint instead (the evaluations' own seconds are subtracted).
        f"--ckpt-frequency={TTA_CHECKPOINT_STEPS if config.time_to_accuracy else 0}",
        *(["--eval-checkpoints"] if config.time_to_accuracy else []),
        "--quiet",
    )
    if config.straggler:
        argv.append(
            f"--straggler=worker=1,start=0,duration={STRAGGLER_FOREVER_SECONDS},slowdown={args.slowdown:g}"
        )
    if config.pin_cores:
        argv.append("--pin-cores")
    return argv


def measure_cluster(config: Config, args: argparse.Namespace, work_dir: str) -> Measurement:
    run_dir = os.path.join(work_dir, slug(config.name))
    log_path = run_dir + ".log"
    started = time.time()
    result = run_json_command(cluster_argv(config, args, run_dir), log_path, timeout=args.config_timeout)
    exited = time.time()
    s = result.summary
    steady = steady_rate(chief_steps(run_dir, config.protocol), args.warmup)
    segment = segment_result(run_dir, config.protocol)
    return Measurement(
        config,
        examples_per_sec=steady if steady is not None else s["examples_per_sec"],
        segment_examples_per_sec=s["examples_per_sec"],
        training_seconds=s["training_seconds"],
        wall_seconds=result.wall_seconds,
        startup=s.get("startup") or {},
        before_launch=segment["started_at"] - started,
        after_end=exited - segment["ended_at"],
        closure_timing=segment.get("closure_timing") or {},
        seconds_to_target=seconds_to_target(run_dir) if config.time_to_accuracy else None,
    )


def seconds_to_target(run_dir: str) -> float | None:
    """Training seconds to TARGET_ACCURACY (the report's one definition), None if never reached."""
    from syncswitch_airflow.report import load_run

    return load_run(run_dir).seconds_to_accuracy(TARGET_ACCURACY)


def segment_result(run_dir: str, protocol: str) -> dict[str, Any]:
    from syncswitch import storage
    from syncswitch.layout import RunLayout

    return storage.read_json(RunLayout(run_dir).segment_result(0, protocol))


def chief_steps(run_dir: str, protocol: str) -> list[dict[str, Any]]:
    from syncswitch.events import read_events
    from syncswitch.layout import RunLayout

    steps = read_events(RunLayout(run_dir).segment_metrics(0, protocol), event="step")
    return [e for e in steps if e.get("samples") is not None]


def steady_rate(steps: list[dict[str, Any]], warmup: float) -> float | None:
    """Examples/s between the first step event past the warm-up share of the samples and the last one."""
    if len(steps) < 2:
        return None
    first_samples, last_samples = steps[0]["samples"], steps[-1]["samples"]
    threshold = first_samples + warmup * (last_samples - first_samples)
    window = [e for e in steps if e["samples"] >= threshold]
    if len(window) < 2 or window[-1]["wall_time"] <= window[0]["wall_time"]:
        return None
    return (window[-1]["samples"] - window[0]["samples"]) / (window[-1]["wall_time"] - window[0]["wall_time"])


# ---- the report ------------------------------------------------------------------------------------


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def baseline_rate(measurements: list[Measurement]) -> float | None:
    rates = [m.examples_per_sec for m in measurements if m.config.is_baseline and m.examples_per_sec]
    return sum(rates) / len(rates) if rates else None


def results_table(measurements: list[Measurement]) -> str:
    base = baseline_rate(measurements)
    rows = []
    for m in measurements:
        if m.config.time_to_accuracy:
            continue
        comparable = m.config.model == "resnet"  # the baseline trains ResNet-20
        ratio = m.examples_per_sec / base if base and m.examples_per_sec and comparable else None
        rows.append(
            [
                m.config.name,
                fmt(m.examples_per_sec, 0) if not m.error else "failed",
                fmt(ratio, 2),
                fmt(m.segment_examples_per_sec, 0),
                fmt(m.startup_seconds, 1),
                fmt(m.training_seconds, 1),
                fmt(m.wall_seconds, 1),
                fmt(m.load_at_start, 1),
            ]
        )
    headers = [
        "config",
        "examples/s",
        "x baseline",
        "examples/s (whole segment)",
        "start -> 1st step (s)",
        "training (s)",
        "wall (s)",
        "load 1m",
    ]
    return markdown_table(headers, rows)


def wall_table(measurements: list[Measurement]) -> str:
    """The command's wall time split: before launch, the start-up parts, training, after the end."""
    rows = [
        [
            m.config.name,
            fmt(m.before_launch, 1),
            *(fmt(m.startup.get(part), 1) for part in STARTUP_PARTS),
            fmt(m.training_seconds, 1),
            fmt(m.after_end, 1),
            fmt(m.wall_seconds, 1),
        ]
        for m in measurements
        if m.startup
    ]
    headers = [
        "config",
        "before launch",
        "process start",
        "cluster connect",
        "build / restore",
        "first step",
        "training",
        "after end",
        "wall",
    ]
    return markdown_table(headers, rows)


def goal_lines(measurements: list[Measurement]) -> list[str]:
    base = baseline_rate(measurements)
    lines = []
    for m in measurements:
        skip = m.config.is_baseline or m.config.straggler or m.config.model != "resnet"
        if skip or not m.examples_per_sec or not base:
            continue
        ratio = m.examples_per_sec / base
        verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
        lines.append(
            f"goal >= {GOAL_RATIO} x baseline without stragglers: {m.config.name}: {ratio:.2f} ({verdict})"
        )
    return lines


def asp_over_bsp_table(measurements: list[Measurement]) -> str:
    """ASP examples/s / BSP examples/s of the same model, cluster size and straggler setting, measured
    side by side: in the steady state (after the warm-up share) and over the whole segment."""
    goals = {("digits", False): 1.0, ("resnet", False): 1.0, ("resnet", True): 1.5}
    groups: dict[tuple[str, bool, int], dict[str, Measurement]] = {}
    for m in measurements:
        if m.config.protocol and not m.config.pin_cores and not m.config.time_to_accuracy:
            key = (m.config.model, m.config.straggler, m.config.workers)
            groups.setdefault(key, {})[m.config.protocol] = m
    rows = []
    for (model, straggler, workers), pair in groups.items():
        bsp, asp = pair.get("bsp"), pair.get("asp")
        if not (bsp and asp and bsp.examples_per_sec and asp.examples_per_sec):
            continue
        ratio = asp.examples_per_sec / bsp.examples_per_sec
        whole = (
            asp.segment_examples_per_sec / bsp.segment_examples_per_sec
            if asp.segment_examples_per_sec and bsp.segment_examples_per_sec
            else None
        )
        goal = goals.get((model, straggler))
        label = {"digits": "digits CNN", "resnet": "ResNet-20, synthetic CIFAR"}[model]
        rows.append(
            [
                label + (", worker 1 slowed" if straggler else ""),
                workers,
                fmt(bsp.examples_per_sec, 0),
                fmt(asp.examples_per_sec, 0),
                fmt(ratio, 2),
                fmt(whole, 2),
                f">= {goal:g}: {'met' if ratio >= goal else 'NOT met'}" if goal else "",
            ]
        )
    headers = [
        "workload",
        "workers",
        "BSP examples/s",
        "ASP examples/s",
        "ASP / BSP",
        "whole segment",
        "goal",
    ]
    return markdown_table(headers, rows)


def accuracy_table(measurements: list[Measurement]) -> str:
    rows = [
        [
            m.config.name,
            fmt(m.seconds_to_target, 1) if m.seconds_to_target else "not reached",
            fmt(m.training_seconds, 1),
        ]
        for m in measurements
        if m.config.time_to_accuracy
    ]
    return markdown_table(
        ["config (digits from scratch)", f"training s to {TARGET_ACCURACY}", "training s (300 steps)"], rows
    )


def closure_table(measurements: list[Measurement]) -> str:
    """Where an ASP closure's time goes (ClusterCoordinator's timers and the in-function step time)."""
    rows = []
    for m in measurements:
        t = m.closure_timing
        if not t or not t.get("closures"):
            continue
        closures = t["closures"]
        rows.append(
            [
                m.config.name,
                closures,
                fmt(t["steps"] / closures, 1),
                fmt(1000 * t["in_function_seconds"] / closures, 1),
                fmt(1000 * t["closure_execution_seconds"] / closures, 1),
                fmt(1000 * t["remote_value_fetch_seconds"] / closures, 1),
            ]
        )
    headers = [
        "config",
        "closures",
        "steps per closure",
        "in function ms",
        "closure_execution ms",
        "remote_value_fetch ms",
    ]
    return markdown_table(headers, rows)


def print_report(measurements: list[Measurement], args: argparse.Namespace, machine: str) -> None:
    print(f"# bench_runtime: {HPARAM_SET} on {PROBLEM}, {BATCH_PER_WORKER} examples per worker per step")
    print(f"machine: {machine}")
    print(
        f"{args.steps} BSP-equivalent steps of {WORKERS} x {BATCH_PER_WORKER} examples per config (the same "
        "examples at 8 workers: a quarter of the steps); "
        f"warm-up {args.warmup:.0%} of the samples; "
        f"straggler: worker 1, slowdown {args.slowdown:g}, whole run"
    )
    print()
    print(results_table(measurements))
    print()
    print("wall time split (s): before launch = CLI start and preflight; the four start-up parts add up to")
    print(
        "start -> 1st step; training ends after the final checkpoint; after end = process exit, cluster stop"
    )
    print()
    print(wall_table(measurements))
    print()
    print("ASP vs BSP, same workers, measured side by side:")
    print()
    print(asp_over_bsp_table(measurements))
    print()
    if any(m.config.time_to_accuracy for m in measurements):
        print(f"time to {TARGET_ACCURACY} test accuracy (evaluated every {TTA_CHECKPOINT_STEPS} steps):")
        print()
        print(accuracy_table(measurements))
        print()
    print("ASP closures, per closure (in function = the steps on the worker; closure_execution and")
    print("remote_value_fetch are ClusterCoordinator's timers on the coordinator):")
    print()
    print(closure_table(measurements))
    print()
    for line in goal_lines(measurements):
        print(line)
    for m in measurements:
        if m.error:
            print(f"{m.config.name} failed: {m.error.splitlines()[0]}")


# ---- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="BSP-equivalent steps per config (default 150, --quick 8)")
    p.add_argument("--quick", action="store_true", help="a few steps per config: a smoke test, not figures")
    p.add_argument("--pin-cores", action="store_true", help="also run every cluster config with --pin-cores")
    p.add_argument("--slowdown", type=float, default=3.0, help="straggler slowdown (> 1)")
    p.add_argument(
        "--steady-state",
        action="store_true",
        help="only BSP and ASP at 2 and 8 workers, digits and ResNet-20 (default --steps 400, --warmup 0.1)",
    )
    p.add_argument("--warmup", type=float, help="share of the samples not timed (0..0.9; default 0.2)")
    p.add_argument(
        "--only",
        default="",
        help="only the configs whose name contains this (e.g. 'ResNet-20' or '2 workers')",
    )
    p.add_argument(
        "--baseline-intra-op-threads",
        type=int,
        default=0,
        help="baseline TF intra-op threads (0: TF default)",
    )
    p.add_argument(
        "--config-timeout",
        type=float,
        default=600.0,
        help="seconds before a config counts as hung: it is stopped and reported as failed",
    )
    p.add_argument("--keep", action="store_true", help="keep the run folders and logs")
    p.add_argument("--baseline-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 400 if args.steady_state else 150)
    args.warmup = args.warmup if args.warmup is not None else 0.1 if args.steady_state else 0.2
    if args.steps < 2 or not 0 <= args.warmup <= 0.9 or args.slowdown <= 1:
        p.error("needs --steps >= 2, 0 <= --warmup <= 0.9 and --slowdown > 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.baseline_child:
        print(json.dumps(baseline_child(args.steps, args.warmup, args.baseline_intra_op_threads)), flush=True)
        return 0
    machine = machine_line()
    work_dir = tempfile.mkdtemp(prefix="bench-runtime-")
    measurements: list[Measurement] = []
    failed = False
    try:
        chosen = steady_state_configs() if args.steady_state else configs(args.pin_cores)
        for config in [c for c in chosen if args.only in c.name]:
            load = load_1m()
            log(f"{config.name}: starting (load {load:.1f})")
            try:
                measure = measure_baseline if config.is_baseline else measure_cluster
                m = measure(config, args, work_dir)
            except BenchError as exc:
                failed = True
                log(f"{config.name}: FAILED: {exc}")
                m = Measurement(config, error=str(exc))
            m.load_at_start = load
            measurements.append(m)
            if not m.error:
                log(f"{config.name}: {m.examples_per_sec:.0f} examples/s, {m.training_seconds:.1f}s training")
    finally:
        if args.keep or failed:
            log(f"run folders and logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    print_report(measurements, args, machine)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
