"""A user model against the built-in one of the same size, side by side in one run (issue 17).

    .venv/bin/python bench/bench_user_model.py              # ~6 minutes on 2 cores
    .venv/bin/python bench/bench_user_model.py --quick      # smoke test

Both train ResNet-20 on ``synthetic_cifar`` (2 workers, 1 PS, 32 examples per worker): the built-in
``resnet`` and ``user_resnet20`` (bench/user_models/bench_models: the same network written as a user
would, a subclassed Keras model with a custom block layer, loaded through ``--usr-dir``). Each model
runs a BSP segment, then an ASP segment that restores its checkpoint (a switch), repeated
``--repeats`` times in alternation so the shared machine's drift hits both alike.

Printed per model: steady-state examples/s of BSP and ASP (after the --warmup share of the samples),
ASP / BSP, and the ASP segment's start-up split (cluster connect, restore, first step with its
tracing): on a warm cluster (the pipeline's fork server), the switch gap is the hand-off plus these.
Process start is left out: these standalone runs import TensorFlow afresh, the pipeline's do not.
Goal: the user model within 10% of the built-in one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

from _common import fmt, log, machine_line, markdown_table, ratio, run_json_command, syncswitch_command
from bench_runtime import chief_steps, steady_rate

USER_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_models", "bench_models")
MODELS = {
    "built-in resnet": ["--model=resnet", "--hparam-set=resnet_cifar_20"],
    "user_resnet20 (usr_dir)": [
        f"--usr-dir={USER_CODE}",
        "--model=user_resnet20",
        "--hparam-set=user_resnet20",
    ],
}
STARTUP_PARTS = ("cluster_connect", "restore", "first_step")
GOAL = 0.9


def run_segment(model: str, protocol: str, until: int, total: int, run_dir: str, timeout: float) -> dict:
    argv = syncswitch_command(
        "train",
        f"--protocol={protocol}",
        "--workers=2",
        "--ps=1",
        "--problem=synthetic_cifar",
        *MODELS[model],
        "--hparams=batch_size=32",
        f"--run-dir={run_dir}",
        f"--until-step={until}",
        f"--total-steps={total}",
        "--ckpt-frequency=0",
        "--quiet",
    )
    return run_json_command(argv, f"{run_dir}-{protocol}.log", timeout=timeout).summary


def measure(model: str, steps: int, warmup: float, work_dir: str, timeout: float) -> dict[str, Any]:
    """One BSP segment of ``steps`` then one ASP segment of ``steps`` from its checkpoint."""
    run_dir = os.path.join(
        work_dir, f"{'user' if 'user' in model else 'builtin'}-{len(os.listdir(work_dir))}"
    )
    run_segment(model, "bsp", steps, 2 * steps, run_dir, timeout)
    asp = run_segment(model, "asp", 2 * steps, 2 * steps, run_dir, timeout)
    rates = {
        protocol: steady_rate(chief_steps_of(run_dir, index, protocol), warmup)
        for index, protocol in ((0, "bsp"), (1, "asp"))
    }
    return {**rates, **{part: asp.get("startup", {}).get(part) for part in STARTUP_PARTS}}


def chief_steps_of(run_dir: str, index: int, protocol: str) -> list[dict[str, Any]]:
    from syncswitch.events import read_events
    from syncswitch.layout import RunLayout

    if index == 0:
        return chief_steps(run_dir, protocol)
    steps = read_events(RunLayout(run_dir).segment_metrics(index, protocol), event="step")
    return [e for e in steps if e.get("samples") is not None]


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    rows, builtin = [], None
    for model, runs in results.items():
        bsp, asp = mean([r["bsp"] for r in runs]), mean([r["asp"] for r in runs])
        switch = mean([sum(r[p] or 0.0 for p in STARTUP_PARTS) for r in runs])
        if builtin is None:
            builtin = (bsp, asp)
        rows.append(
            [
                model,
                bsp,
                asp,
                fmt(ratio(asp, bsp), 2),
                fmt(ratio(bsp, builtin[0]), 2),
                fmt(ratio(asp, builtin[1]), 2),
                *(mean([r[p] for r in runs]) for p in STARTUP_PARTS),
                switch,
            ]
        )
    headers = ["model", "BSP ex/s", "ASP ex/s", "ASP/BSP", "BSP vs built-in", "ASP vs built-in"]
    headers += [f"{p} s" for p in STARTUP_PARTS] + ["switch start-up s"]
    print(markdown_table(headers, rows))
    user = rows[-1]
    ok = all(r != "-" and float(r) >= GOAL for r in user[4:6])
    print(f"goal (user model >= {GOAL:.0%} of the built-in, BSP and ASP): {'met' if ok else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="BSP-equivalent steps per segment (default 300, --quick 20)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=float, default=0.2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the run folders and logs")
    args = p.parse_args(argv)
    steps = args.steps or (20 if args.quick else 300)
    work_dir = tempfile.mkdtemp(prefix="bench-user-model-")
    print(machine_line())
    results: dict[str, list[dict[str, Any]]] = {model: [] for model in MODELS}
    try:
        for repeat in range(1 if args.quick else args.repeats):
            for model in MODELS:
                log(f"repeat {repeat + 1}: {model}, {steps} BSP + {steps} ASP steps")
                results[model].append(measure(model, steps, args.warmup, work_dir, timeout=900))
        print(
            f"\nResNet-20 on synthetic_cifar, 2 workers + 1 PS, {steps} + {steps} steps, mean of "
            f"{len(results[next(iter(MODELS))])} run(s):\n"
        )
        report(results)
    finally:
        if args.keep:
            print(f"run folders kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
