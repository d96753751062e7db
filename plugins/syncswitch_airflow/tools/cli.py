"""``syncswitch run``: the original main.py flags, run as a ``sync_switch`` DAG run on an embedded Airflow.

    syncswitch run                                     # the demo job, on the defaults (JobSpec())
    syncswitch run --switch-order 101 --train-steps 50 200 50 --hparams "" "learning_rate=0.05" ""
    syncswitch run --total-steps 2000 --bsp-fraction 0.25 --online-policy greedy \\
        --straggler worker=1,start=20,duration=60,slowdown=4 --keep-ui

Flow: flags -> conf -> ``JobSpec.from_params`` (bad input: one line naming the field, exit 2, nothing
started) -> start or reuse the embedded Airflow -> trigger ``sync_switch`` with the conf over REST ->
task states and training progress while it runs -> the report's summary lines -> one JSON object as the
last line of stdout. Exit 0 when the run succeeded, 1 when it failed, 2 on bad input, 130 on Ctrl-C.
Airflow is stopped at the end unless ``--keep-ui``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

from syncswitch import storage
from syncswitch.costs import cost_headline
from syncswitch.events import EventTail
from syncswitch.fields import FIELDS_BY_NAME, add_job_flags, flag_aliases, params_from_flags
from syncswitch.layout import RunLayout
from syncswitch.plan import step_text
from syncswitch.spec import JobSpec, SpecError

from syncswitch_airflow.embedded.airflow import AirflowGone, EmbeddedAirflow
from syncswitch_airflow.embedded.airflow_api import AirflowApi, AirflowError, TriggerRejected
from syncswitch_airflow.embedded.instance import ADMIN_PASSWORD, ADMIN_USER

DAG_ID = "sync_switch"
PROG = "syncswitch run"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
_POLL_SECONDS = 2.0
_PROGRESS_EVERY_SECONDS = 5.0
_TEARDOWN_WAIT_SECONDS = 120.0
# How often one `syncswitch run` starts the embedded Airflow again after it went away.
_AIRFLOW_RESTARTS = 3

# Flags of the original main.py that this command takes and ignores (the backend names the cluster).
IGNORED_FLAGS = ("--cluster-name", "--eval-name")


class UsageError(Exception):
    """A flag argparse rejects (unknown flag, missing value): reported in one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True)
class RunOptions:
    """What the CLI itself does, beyond the job: where Airflow lives and what to print."""

    project_dir: Path
    airflow_home: Path | None
    boot_timeout: float | None
    keep_ui: bool
    json_only: bool
    stop_ui: bool


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    original = add_job_flags(parser)
    for flag in IGNORED_FLAGS:
        original.add_argument(*flag_aliases(flag), default=None, help="accepted and ignored")
    cli = parser.add_argument_group("this command")
    cli.add_argument(
        "--keep-ui", action="store_true", help="leave Airflow running; print the UI URL and login"
    )
    cli.add_argument("--stop-ui", action="store_true", help="stop a kept embedded Airflow and exit")
    cli.add_argument("--json-only", action="store_true", help="stdout gets only the final JSON line")
    cli.add_argument("--project-dir", default=None, help="folder holding dags/ and plugins/")
    cli.add_argument("--airflow-home", default=None, help="AIRFLOW_HOME (default <project>/.airflow)")
    cli.add_argument(
        "--airflow-boot-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the embedded Airflow may take to boot "
        "(default $SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT or 1800; a busy machine needs minutes)",
    )
    return parser


def parse(argv: list[str]) -> tuple[JobSpec, RunOptions, list[str]]:
    """Flags -> validated JobSpec, CLI options and notes for stderr. Raises UsageError / SpecError."""
    args = build_parser().parse_args(argv)
    notes = [
        f"note: {flag} is accepted for compatibility with the original main.py and ignored: "
        "the cluster backend provisions the cluster and evaluation runs inside the DAG run"
        for flag in IGNORED_FLAGS
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None
    ]
    if args.airflow_boot_timeout is not None and args.airflow_boot_timeout <= 0:
        raise UsageError(f"--airflow-boot-timeout must be > 0 seconds, got {args.airflow_boot_timeout}")
    spec = JobSpec.from_params(params_from_flags(args))
    project_dir = Path(args.project_dir).resolve() if args.project_dir else default_project_dir()
    options = RunOptions(
        project_dir=project_dir,
        airflow_home=Path(args.airflow_home).resolve() if args.airflow_home else None,
        boot_timeout=args.airflow_boot_timeout,
        keep_ui=args.keep_ui,
        json_only=args.json_only,
        stop_ui=args.stop_ui,
    )
    return spec, options, notes


def default_project_dir() -> Path:
    """The checkout this package is installed from (editable install), else the current folder (an
    installed package: the embedded Airflow then serves the DAG files the package carries, and runs,
    job files and the Airflow home live in this folder)."""
    checkout = Path(__file__).resolve().parents[3]
    return checkout if (checkout / "dags").is_dir() else Path.cwd()


def dag_conf(spec: JobSpec) -> dict[str, Any]:
    """The DAG run conf: every JobSpec param, with a local bucket_dir made absolute.

    Airflow's tasks run in the project folder, so a relative bucket_dir would otherwise land somewhere
    other than where the user ran the command.
    """
    conf = spec.to_params()
    if not storage.is_remote(spec.bucket_dir):
        conf["bucket_dir"] = os.path.abspath(spec.bucket_dir)
    return conf


def flag_for(field_name: str) -> str:
    """The flag that sets a field named in an error ("switch_order/max_online_switches": the first)."""
    field = FIELDS_BY_NAME.get(field_name.split("/")[0].split(".")[0])
    return field.flag if field else "--" + field_name.replace("_", "-")


# ---- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``syncswitch run`` (argv excludes the word ``run``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec, options, notes = parse(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SpecError as exc:
        message = str(exc).split(": ", 1)[-1]
        print(f"{PROG}: error: {exc.field} ({flag_for(exc.field)}): {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in notes:
        print(note, file=sys.stderr)
    with _event_log_to_stderr():
        airflow = EmbeddedAirflow(options.project_dir, options.airflow_home)
        if options.stop_ui:
            airflow.stop()
            return EXIT_OK
        with interrupt_on_sigterm():
            return RunSession(airflow, spec, options).run()


@contextlib.contextmanager
def _event_log_to_stderr() -> Iterator[None]:
    """Our one-line event logs go to stderr, whatever logging setup importing Airflow installed
    (its structlog handlers write to stdout, which must end with the JSON line)."""
    logger = logging.getLogger("syncswitch_airflow")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved


def fail_run_for_teardown(api: AirflowApi, run_id: str) -> None:
    """After Ctrl-C: mark the run failed so that Airflow runs teardown_cluster, and give it time to
    finish (a second Ctrl-C skips the wait)."""
    try:
        print(f"failing run {run_id} so its teardown runs (Ctrl-C again to skip)", file=sys.stderr)
        if not api.fail_run(DAG_ID, run_id, _TEARDOWN_WAIT_SECONDS, _POLL_SECONDS):
            print(
                f"run {run_id}: its tasks did not finish within {_TEARDOWN_WAIT_SECONDS:.0f} s",
                file=sys.stderr,
            )
    except (KeyboardInterrupt, AirflowError) as exc:
        print(f"teardown wait skipped: {exc or 'interrupted'}", file=sys.stderr)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside (from the main thread; elsewhere it changes nothing),
    so that it gets Ctrl-C's clean stop: the run in flight failed and torn down."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_airflow(airflow: EmbeddedAirflow) -> None:
    """Stop the embedded Airflow, even through a second Ctrl-C."""
    try:
        airflow.stop()
    except KeyboardInterrupt:
        # A second Ctrl-C while stopping: finish the stop anyway, nothing may be left behind.
        airflow.stop(timeout=5.0)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class RunSession:
    """One ``syncswitch run``: start Airflow, trigger, follow, summarise, stop."""

    def __init__(self, airflow: EmbeddedAirflow, spec: JobSpec, options: RunOptions) -> None:
        self.airflow = airflow
        self.spec = spec
        self.options = options
        self.conf = dag_conf(spec)
        # Human lines go to stdout, or to stderr when stdout must carry only the JSON line.
        self.out: TextIO = sys.stderr if options.json_only else sys.stdout
        self.run_id: str | None = None
        self.layout: RunLayout | None = None
        self.started = time.monotonic()

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def run(self) -> int:
        error = None
        try:
            self.airflow.start(wait_for_dags=(DAG_ID,), timeout=self.options.boot_timeout)
            self.run_id = self.airflow.api.trigger(DAG_ID, self.conf)
            self.started = time.monotonic()  # progress and dag_run_seconds count from the trigger
            self.layout = RunLayout.for_run(self.conf["bucket_dir"], self.spec.job_name, self.run_id)
            self.say(f"run {self.run_id}: switch order {self.spec.switch_order}, {self.spec.workload} steps")
            self.say(f"run folder {self.layout.root}")
            state = self.follow()
            code = EXIT_OK if state == "success" else EXIT_FAILED
        except TriggerRejected as exc:
            error = f"Airflow rejected the conf: {exc}"
            state, code = "rejected", EXIT_BAD_INPUT
        except AirflowError as exc:
            error = str(exc)
            state, code = "error", EXIT_FAILED
        except KeyboardInterrupt:
            error = "interrupted"
            if self.run_id is not None:
                fail_run_for_teardown(self.airflow.api, self.run_id)
            state, code = "interrupted", EXIT_INTERRUPTED
        if error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
        try:
            result = self._result(state, error)
        finally:
            self._stop_or_keep()
        if self.options.keep_ui and self.airflow.is_running():
            result["airflow_url"] = self.airflow.url
        print(json.dumps(result, default=str), flush=True)
        return code

    def follow(self) -> str:
        progress = ProgressPrinter(self.layout, self.spec.workload, self.say, self.started)
        task_states: dict[str, str | None] = {}

        def on_poll(state: str, tasks: dict[str, str | None]) -> None:
            # One line per new state, naming every task that reached it since the last poll (the
            # unused segment slots all skip at once).
            changed: dict[str, list[str]] = {}
            for task_id, task_state in tasks.items():
                if task_state and task_states.get(task_id) != task_state:
                    changed.setdefault(task_state, []).append(task_id)
            for task_state, task_ids in changed.items():
                self.say(f"[{self._elapsed()}] {', '.join(task_ids)}: {task_state}")
            task_states.update(tasks)
            progress.update()

        restarts_seen: dict[str, dict] = {}

        def on_poll_with_components(state: str, tasks: dict[str, str | None]) -> None:
            for name, seen in self.airflow.component_restarts().items():
                if restarts_seen.get(name) != seen:
                    exit_code, count = seen["last_exit"], seen["restarts"]
                    self.say(
                        f"[{self._elapsed()}] embedded Airflow: the {name} stopped (exit {exit_code}) "
                        f"and was restarted (restart {count})"
                    )
            restarts_seen.update(self.airflow.component_restarts())
            on_poll(state, tasks)

        # A run that takes days is a user's choice. If the embedded Airflow itself goes away, it is
        # started again: the run's state is in its database and its training never stopped.
        for attempt in range(_AIRFLOW_RESTARTS + 1):
            try:
                state = self.airflow.api.wait(
                    DAG_ID, self.run_id, timeout=7 * 24 * 3600.0, on_poll=on_poll_with_components
                )
                break
            except AirflowGone as exc:
                if attempt == _AIRFLOW_RESTARTS:
                    raise
                reason = str(exc).splitlines()[0]
                self.say(f"[{self._elapsed()}] {reason}; starting it again, run {self.run_id} continues")
                self.airflow.start(wait_for_dags=(DAG_ID,), timeout=self.options.boot_timeout)
                restarts_seen.clear()
        self.say(f"[{self._elapsed()}] run {state}")
        return state

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.0f}s"

    def _stop_or_keep(self) -> None:
        if self.options.keep_ui and self.airflow.is_running():
            self.say(f"Airflow UI: {self.airflow.url}  (user {ADMIN_USER}, password {ADMIN_PASSWORD})")
            self.say(f"stop it with: {PROG} --stop-ui" + self._home_flag())
            return
        stop_airflow(self.airflow)

    def _home_flag(self) -> str:
        return f" --airflow-home {self.options.airflow_home}" if self.options.airflow_home else ""

    def _summary(self) -> dict[str, Any]:
        """The report's summary.json, or the same numbers computed from the run folder when the report
        task did not get to write it (a failed or interrupted run). Empty if the run wrote nothing."""
        from syncswitch_airflow.report import load_run, summarize

        if self.layout is None or not storage.exists(self.layout.state):
            return {}
        summary = storage.read_json(self.layout.report + "/summary.json", default={})
        return summary or summarize(load_run(self.layout.root))

    def _result(self, state: str, error: str | None) -> dict[str, Any]:
        """The final JSON line; prints the report's summary lines on the way."""
        from syncswitch_airflow.report import format_summary_lines

        summary = self._summary()
        if summary:
            for line in format_summary_lines(summary):
                self.say(line)
        segments = [
            {
                "index": s.get("index"),
                "protocol": s.get("protocol"),
                "steps": s.get("steps"),
                "seconds": s.get("seconds"),
                "examples_per_sec": s.get("examples_per_sec"),
                "test_accuracy": s.get("test_accuracy"),
                "status": s.get("status"),
            }
            for s in summary.get("segments", [])
        ]
        result = {
            "state": state,
            "run_id": self.run_id,
            "run_dir": self.layout.root if self.layout else None,
            "final_accuracy": summary.get("final_accuracy"),
            "segments": segments,
            "switch_gaps_seconds": [g.get("seconds") for g in summary.get("switch_gaps_seconds", [])],
            "total_seconds": summary.get("total_seconds"),
            # As this command saw it (it polls every 2 s), and as Airflow records it (queued -> ended).
            "dag_run_seconds": round(time.monotonic() - self.started, 3),
            "airflow_run_seconds": self._airflow_run_seconds(),
            # Every online-policy decision (switch, switch back, stay) with its reason and numbers.
            "online_switches": summary.get("online_switches") or [],
            # gce clusters: revocations and replacements, and the run's bill (null elsewhere).
            "cluster_events": summary.get("cluster_events") or [],
            "cost": cost_headline(summary.get("cost")),
            "report": summary.get("index_html"),
        }
        if error:
            result["error"] = error
        return result

    def _airflow_run_seconds(self) -> float | None:
        """The run's duration in Airflow's record, from queued to ended; None where it has not ended
        or Airflow no longer answers (an interrupted command)."""
        if self.run_id is None:
            return None
        try:
            record = self.airflow.api.dag_run(DAG_ID, self.run_id)
        except (AirflowError, OSError):
            return None
        queued, ended = record.get("queued_at"), record.get("end_date")
        if not (queued and ended):
            return None
        seconds = datetime.datetime.fromisoformat(ended) - datetime.datetime.fromisoformat(queued)
        return round(seconds.total_seconds(), 3)


class ProgressPrinter:
    """Training progress from the run folder: for the running segment (state.json's plan), the latest
    ``step`` event (written by the chief: the ASP coordinator, BSP worker 0), at most every few
    seconds; for each segment that ends, where it ended (its ``segment_end`` event)."""

    def __init__(self, layout: RunLayout, workload: int, say: Callable[[str], None], started: float) -> None:
        self.layout = layout
        self.workload = workload
        self.say = say
        self.started = started
        self._tails: dict[str, EventTail] = {}
        # segment metrics folder -> its latest step event / its segment_end event
        self._last_step: dict[str, dict[str, Any]] = {}
        self._ended: dict[str, dict[str, Any]] = {}
        self._finished: set[str] = set()
        self._printed: tuple[str, float] | None = None
        self._printed_at = 0.0

    def update(self) -> None:
        try:
            state = storage.read_json(self.layout.state, default={}) or {}
        except ValueError:  # state.json mid-write on a filesystem without atomic rename
            return
        done = {str(k) for k in (state.get("segments") or {})}
        for entry in state.get("plan") or []:
            folder = self.layout.segment_metrics(entry["index"], entry["protocol"])
            if folder in self._finished:
                continue
            self._read_events(folder)
            if str(entry["index"]) in done or folder in self._ended:
                # A short segment can start and end between two polls: show where it ended anyway.
                self._finished.add(folder)
                self._show_end(folder)
                continue
            self._show_step(folder)
            return  # later entries have not started

    def _read_events(self, folder: str) -> None:
        for event in self._new_events(folder):
            if event.get("event") == "step":
                self._last_step[folder] = event
            elif event.get("event") == "segment_end":
                self._ended[folder] = event

    def _show_step(self, folder: str) -> None:
        step = self._last_step.get(folder)
        now = time.monotonic()
        if step is None or self._printed == (folder, step.get("global_step")):
            return
        if now - self._printed_at < _PROGRESS_EVERY_SECONDS:
            return
        self._printed, self._printed_at = (folder, step.get("global_step")), now
        self.say(
            f"{self._prefix(step)}  step {step_text(step.get('global_step'))}/{self.workload}"
            f"  loss {_num(step.get('loss'), 4)}  {_num(step.get('examples_per_sec'), 0)} examples/s"
        )

    def _show_end(self, folder: str) -> None:
        end = self._ended.get(folder)
        if end is None:
            return
        line = (
            f"{self._prefix(end)}  ended at step {step_text(end.get('global_step'))}/{self.workload}"
            f"  {_num(end.get('examples_per_sec'), 0)} examples/s  ({end.get('reason')})"
        )
        step = self._last_step.get(folder)
        if step is not None:
            # Steps are logged every few steps, so the last logged loss may be from before the end.
            line += f"  last loss {_num(step.get('loss'), 4)} at step {step_text(step.get('global_step'))}"
        self.say(line)

    def _prefix(self, event: dict[str, Any]) -> str:
        return (
            f"[{time.monotonic() - self.started:6.0f}s] segment {event.get('segment')} "
            f"{str(event.get('protocol')).upper()}"
        )

    def _new_events(self, folder: str) -> list[dict[str, Any]]:
        tail = self._tails.setdefault(folder, EventTail(folder))
        try:
            return tail.read_new()
        except OSError:
            return []


def _num(value: Any, digits: int) -> str:
    return "?" if value is None else f"{float(value):.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
