"""Helpers shared by the bench scripts: running our commands as child processes and printing tables.

The benchmarks drive the real commands (``syncswitch train``, ``syncswitch run``) as child processes, so
what they time is what a user gets. Tables are printed as Markdown so they can be pasted into
docs/benchmarks.md unchanged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from syncswitch_airflow.report.page import fmt as report_cell

# A clean stop of `syncswitch run` stops Airflow and tears the cluster down; give it that long.
STOP_GRACE_SECONDS = 180.0


class BenchError(RuntimeError):
    """A benchmarked command failed; the message carries its exit code and the tail of its stderr."""


@dataclass(frozen=True)
class CommandResult:
    """The last JSON line a command printed, how long it ran and where its stderr went."""

    summary: dict[str, Any]
    wall_seconds: float
    log_path: str


def syncswitch_command(*args: str) -> list[str]:
    """The `syncswitch` CLI in this interpreter's environment (the project's .venv)."""
    return [sys.executable, "-m", "syncswitch.cli", *args]


def run_command(
    argv: Sequence[str], log_path: str, *, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """Run ``argv`` with stderr in ``log_path``; returns (exit code, stdout, wall seconds).

    On timeout or Ctrl-C the child gets SIGTERM (our commands stop their clusters and Airflow on it)
    and a grace period before SIGKILL, so nothing is left running.
    """
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log_file:
        child = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=log_file, text=True, env={**os.environ, **(env or {})}
        )
        try:
            stdout, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(child)
            raise BenchError(f"timed out after {timeout:.0f}s; log: {log_path}\n{' '.join(argv)}") from None
        except KeyboardInterrupt:
            _stop(child)
            raise
    return child.returncode, stdout, time.monotonic() - started


def run_json_command(
    argv: Sequence[str], log_path: str, *, timeout: float, env: dict[str, str] | None = None
) -> CommandResult:
    """Run ``argv`` (see run_command) and return the JSON object on its last stdout line."""
    code, stdout, wall = run_command(argv, log_path, timeout=timeout, env=env)
    summary = last_json_line(stdout)
    if code != 0 or summary is None:
        # First line short (the report prints it); then the command and the log's tail.
        raise BenchError(
            f"exited with {code}; log: {log_path}\n{' '.join(argv)}\n"
            f"--- last lines of {log_path} ---\n{tail(log_path)}"
        )
    return CommandResult(summary, wall, log_path)


def _stop(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGTERM)
    try:
        child.communicate(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()


def last_json_line(stdout: str) -> dict[str, Any] | None:
    """The last line of ``stdout`` that parses as a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell as the run reports write one (numbers rounded, missing values as a dash), with
    one decimal by default."""
    return report_cell(value, digits)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None where either is missing or zero (a cell left as a dash)."""
    return numerator / denominator if numerator and denominator else None


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown pipe table with right-aligned columns after the first."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def machine_line() -> str:
    """When and where the figures were taken: date, cores, load, versions."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {platform.node()}; "
        f"{os.cpu_count()} cores; load average {load}; Python {platform.python_version()}; "
        f"tensorflow-cpu {_version('tensorflow-cpu')}; apache-airflow {_version('apache-airflow')}"
    )


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def load_1m() -> float:
    return os.getloadavg()[0]


def log(message: str) -> None:
    """Progress of the benchmark itself, on stderr so stdout carries only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def add_airflow_home_argument(parser: argparse.ArgumentParser) -> None:
    """--airflow-home for the benchmarks that drive `syncswitch run` on an embedded Airflow."""
    parser.add_argument(
        "--airflow-home",
        default=os.path.join(tempfile.gettempdir(), "syncswitch-bench-airflow"),
        help="the embedded Airflow's home (default: a bench-only one, so a shared instance is left alone)",
    )


def split_passthrough(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(the script's own arguments, those after ``--``, which go to `syncswitch run`)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def wait_for_bsp_step(layout: Any, step: float, timeout: float = 600) -> None:
    """Until the run's first (BSP) segment has reported ``step``; BenchError after ``timeout`` s."""
    from syncswitch.events import read_events

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = read_events(layout.segment_metrics(0, "bsp"), event="step")
        if steps and steps[-1]["global_step"] >= step:
            return
        time.sleep(0.5)
    raise BenchError(f"the BSP segment did not reach step {step} in {timeout:.0f} s")
