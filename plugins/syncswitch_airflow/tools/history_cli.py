"""``syncswitch history`` and ``syncswitch policy``: a recurring job's history and its timing policy.

    syncswitch history JOB [--bucket-dir DIR] [--json] [policy flags]
    syncswitch history import JOB FILE.jsonl [--bucket-dir DIR]
    syncswitch policy next --history FILE.jsonl [--fingerprint F] [policy flags]

    policy flags: [--repeats K] [--tolerance T] [--floor F] [--refine N]   (syncswitch_airflow.timing)

``history`` prints the job's records in completion order, then each fingerprint's search state and the
decision the next run would get (``--json``: all of it as one JSON object). ``history import`` adds the
records of a .jsonl file (docs/history.md), each as its own immutable record. ``policy next`` decides
from a .jsonl history without a bucket: the reasoning goes to stderr and the last stdout line is one
JSON object (``bsp_fraction``, ``phase``, ``reason``, ``numbers``, ``fingerprint``). A .jsonl history has
no claims, so nothing is in flight. The bucket defaults to the job file's ``bucket_dir`` (as its DAG
runs use it), else ``[syncswitch] bucket_dir``, else ``./runs``.

Exit 0 on success; 2 on bad input (a flag, a field of a record, a conflicting import), with one line
naming the flag or field and what it accepts. Kept apart from ``syncswitch.cli`` and imported lazily, so
cluster nodes never import it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from syncswitch import storage
from syncswitch.spec import JobSpec

from syncswitch_airflow import settings
from syncswitch_airflow.history import (
    RecordError,
    check_job_name,
    import_records,
    read_claims,
    read_jsonl,
    read_records,
)
from syncswitch_airflow.timing import TimingConfig, completion_key, search_state

EXIT_OK, EXIT_BAD_INPUT = 0, 2
DEFAULT_BUCKET_DIR = "runs"
FINGERPRINT_PREFIX = 8
# TimingConfig field -> the flag that sets it, so a validation error names what the user typed.
POLICY_FLAGS = {
    "repeats": "--repeats",
    "tolerance": "--tolerance",
    "floor": "--floor",
    "refine": "--refine",
}


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


# ---- parsers ---------------------------------------------------------------------------------------


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    defaults = TimingConfig()
    group = parser.add_argument_group("timing policy (docs/history.md)")
    group.add_argument(
        "--repeats", help=f"k: runs per candidate and baseline runs (default {defaults.repeats})"
    )
    group.add_argument(
        "--tolerance", help=f"accept while mean >= baseline mean - tolerance (default {defaults.tolerance:g})"
    )
    group.add_argument(
        "--floor", help=f"smallest fraction searched, in (0, 0.5] (default {defaults.floor:g})"
    )
    group.add_argument(
        "--refine", help=f"bisection steps after the first rejection (default {defaults.refine})"
    )


def _bucket_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bucket-dir",
        help="local folder or gs:// URI (default: the job file's bucket_dir, else [syncswitch] bucket_dir, "
        f"else ./{DEFAULT_BUCKET_DIR})",
    )


def build_history_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="syncswitch history",
        description="A job's history (completion order) and its timing search state. "
        "'syncswitch history import JOB FILE.jsonl' imports records.",
        allow_abbrev=False,
    )
    parser.add_argument("job", metavar="JOB", help="the job's name, or its job file")
    _bucket_flag(parser)
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")
    _add_policy_flags(parser)
    return parser


def build_import_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="syncswitch history import",
        description="Import a .jsonl history (one record per line, docs/history.md) into a job.",
        allow_abbrev=False,
    )
    parser.add_argument("job", metavar="JOB", help="the job's name, or its job file")
    parser.add_argument("file", metavar="FILE.jsonl", help="local path or gs:// URI")
    _bucket_flag(parser)
    return parser


def build_policy_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="syncswitch policy next",
        description="The BSP fraction the next run would get from a .jsonl history. The reasoning goes "
        "to stderr; the last stdout line is one JSON object.",
        allow_abbrev=False,
    )
    parser.add_argument("--history", required=True, metavar="FILE.jsonl", help="local path or gs:// URI")
    parser.add_argument("--fingerprint", help="default: the fingerprint of the newest record in the file")
    _add_policy_flags(parser)
    return parser


def timing_config(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> TimingConfig:
    """The policy flags as a validated TimingConfig, over ``defaults`` (a job file's settings);
    raises UsageError naming the flag."""
    values: dict[str, Any] = dict(defaults or {})
    for name in POLICY_FLAGS:
        raw = getattr(args, name)
        if raw is not None:
            values[name] = _number_or_text(raw, integer=name in ("repeats", "refine"))
    config = TimingConfig(**values)
    try:
        config.validate()
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        flag = POLICY_FLAGS.get(field.removeprefix("timing_"), field)
        raise UsageError(f"{flag}: {message}") from None
    return config


def _number_or_text(raw: str, *, integer: bool) -> Any:
    # Unparseable text is passed on as is: TimingConfig.validate() rejects it with the accepted values.
    try:
        return int(raw) if integer else float(raw)
    except ValueError:
        return raw


# ---- syncswitch history ------------------------------------------------------------------------------


def history_main(argv: list[str]) -> int:
    """``syncswitch history ...`` (argv excludes the word ``history``); returns the exit status."""
    if argv and argv[0] == "import":
        return _guarded("syncswitch history import", _import, argv[1:])
    return _guarded("syncswitch history", _show, argv)


def _import(argv: list[str]) -> int:
    args = build_import_parser().parse_args(argv)
    args.job, job = resolve_job(args.job)
    _require_file(args.file, "FILE.jsonl")
    if not args.bucket_dir:  # the job file is read only for its bucket_dir
        args.bucket_dir = job_bucket_dir(None, job)
    counts = import_records(args.bucket_dir, args.job, args.file)
    print(
        f"imported {counts['written']} record(s) into job {args.job} in {args.bucket_dir} "
        f"({counts['unchanged']} already there, unchanged)"
    )
    return EXIT_OK


def jobs_folder() -> Path:
    """Where job files are read from: ``jobs/`` of the project, or ``[syncswitch] jobs_dir``."""
    from syncswitch_airflow.job_files import jobs_dir
    from syncswitch_airflow.tools.cli import default_project_dir

    return jobs_dir(default_project_dir())


def find_job_file(job: str) -> Path | None:
    """``<job>.yaml`` (or .yml) in the jobs folder, or None."""
    folder = jobs_folder()
    return next((p for p in (folder / f"{job}.yaml", folder / f"{job}.yml") if p.is_file()), None)


def read_job(job: str) -> JobSpec | None:
    """The job of ``job``'s job file, or None without one; UsageError for a bad job file."""
    path = find_job_file(job)
    return None if path is None else _read_job_file(path)


def _read_job_file(path: Path) -> JobSpec:
    from syncswitch_airflow.job_files import JobFileError, read_job_file

    try:
        return read_job_file(path).job
    except JobFileError as err:
        raise UsageError(f"job file {err}") from None


def job_timing(spec: JobSpec | None) -> dict[str, Any]:
    """The job file's timing settings, so that the search state shown is the one the job's runs
    decide by; {} without a job file."""
    if spec is None:
        return {}
    return {
        "repeats": spec.timing_repeats,
        "tolerance": spec.timing_tolerance,
        "floor": spec.timing_floor,
        "refine": spec.timing_refine,
    }


def job_bucket_dir(flag: str | None, spec: JobSpec | None) -> str:
    """Where the job's records are: the flag, else the job file's bucket_dir (as its DAG runs use it),
    else the deployment's."""
    if flag:
        return flag
    if spec is not None and spec.bucket_dir != JobSpec().bucket_dir:
        return spec.bucket_dir
    return settings.get("bucket_dir") or DEFAULT_BUCKET_DIR


def resolve_job(job: str) -> tuple[str, JobSpec | None]:
    """JOB as given (a job's name, or the path of its job file): the job's name and its job file's
    job (None without one); UsageError for a bad name or job file."""
    path = Path(job)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise UsageError(f"JOB: no job file {job}")
        spec = _read_job_file(path)
        return spec.job_name, spec
    check_job_name(job)
    return job, read_job(job)


def _show(argv: list[str]) -> int:
    args = build_history_parser().parse_args(argv)
    args.job, job = resolve_job(args.job)
    config = timing_config(args, job_timing(job))
    args.bucket_dir = job_bucket_dir(args.bucket_dir, job)
    records = read_records(args.bucket_dir, args.job)
    claims = read_claims(args.bucket_dir, args.job)
    now = time.time()
    states = [search_state(records, claims, fp, config, now) for fp in fingerprints_oldest_first(records)]
    if args.json:
        print(json.dumps({"job_name": args.job, "records": records, "claims": claims, "search": states}))
        return EXIT_OK
    print(f"job {args.job} in {args.bucket_dir}: {len(records)} record(s), {len(claims)} claim(s)")
    if not states:
        print("no records yet: the next run is a BSP baseline run (bsp_fraction 1.0)")
        if job is None:
            # A typo in the job name or the bucket looks the same as a job that never ran.
            print(f"(no job file {args.job}.yaml in {jobs_folder()} either: check the name and --bucket-dir)")
        return EXIT_OK
    print(format_table(records))
    current = states[-1]["fingerprint"]
    for state in states:
        print()
        print("\n".join(format_search_state(state, current=state["fingerprint"] == current)))
    return EXIT_OK


def fingerprints_oldest_first(records: list[dict[str, Any]]) -> list[str]:
    """Each fingerprint once, ordered by its newest record: the last one is the current configuration."""
    newest: dict[str, tuple[float, str]] = {}
    for record in records:
        key = completion_key(record)
        newest[record["fingerprint"]] = max(newest.get(record["fingerprint"], key), key)
    return sorted(newest, key=newest.__getitem__)


TABLE_COLUMNS = (
    "finished_at",
    "run_id",
    "logical_date",
    "status",
    "fraction",
    "accuracy",
    "total s",
    "bsp s",
    "asp s",
    "other s",
    "order",
    "phase",
    "fingerprint",
)


def format_table(records: list[dict[str, Any]]) -> str:
    """The records as an aligned text table, in the order given (completion order from read_records)."""
    rows = [TABLE_COLUMNS, *(_table_row(r) for r in records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _table_row(record: dict[str, Any]) -> tuple[str, ...]:
    seconds = record.get("training_seconds") or {}
    return (
        _utc(record.get("finished_at")),
        record["run_id"],
        record.get("logical_date") or "-",
        record["status"],
        f"{record['bsp_fraction']:g}",
        _maybe(record.get("final_accuracy"), ".4f"),
        _maybe(record.get("total_seconds"), ".1f"),
        _maybe(seconds.get("bsp"), ".1f"),
        _maybe(seconds.get("asp"), ".1f"),
        _maybe(sum(v for k, v in seconds.items() if k not in ("bsp", "asp")), ".1f"),
        record.get("switch_order") or "-",
        record.get("policy_phase") or "-",
        record["fingerprint"][:FINGERPRINT_PREFIX],
    )


def _utc(epoch: Any) -> str:
    # finished_at 0 means "not known" (an imported record without it): show that, not 1970.
    if not epoch:
        return "-"
    return datetime.datetime.fromtimestamp(float(epoch), datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _maybe(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_search_state(state: dict[str, Any], *, current: bool) -> list[str]:
    """Lines describing one fingerprint's generations and the next run's decision."""
    config = state["config"]
    label = "current configuration" if current else "an earlier configuration"
    lines = [
        f"search state, fingerprint {state['fingerprint']} ({label}; repeats {config['repeats']}, "
        f"tolerance {config['tolerance']:g}, floor {config['floor']:g}, refine {config['refine']})"
    ]
    for generation in state["generations"]:
        lines.extend(_generation_lines(generation))
    decision = state["decision"]
    lines.append(
        f"  next run: bsp_fraction {decision['bsp_fraction']:g} ({decision['phase']}): {decision['reason']}"
    )
    return lines


def _generation_lines(generation: dict[str, Any]) -> list[str]:
    runs = len(generation["runs"])
    lines = [f"  generation {generation['generation']}: {runs} successful run(s) of this configuration"]
    lines.append(_item_line("baseline 1.0", generation["baseline"]))
    lines.extend(_item_line(f"{item['kind']} {item['fraction']:g}", item) for item in generation["items"])
    if generation["threshold"] is not None:
        lines.append(f"    accept at mean >= {generation['threshold']:.4f} (baseline mean - tolerance)")
    if generation["finished"]:
        exploit = generation["exploit"]
        lines.append(
            f"    chosen {generation['chosen_fraction']:g} (search ended by run "
            f"{generation['search_ended_by']}); {len(exploit['runs'])} exploit run(s), "
            f"latest mean {_maybe(exploit['recent_mean'], '.4f')}"
        )
    drift = generation["drift"]
    if drift:
        lines.append(
            f"    drift at run {drift['run_id']}: latest mean {drift['recent_mean']:.4f} < accepted "
            f"{drift['accepted_mean']:.4f} - tolerance; a new generation starts"
        )
    return lines


def _item_line(name: str, item: dict[str, Any]) -> str:
    if not item["n"]:
        return f"    {name:<16} no runs yet  {item['verdict']}"
    extra = f", +{len(item['extra_runs'])} extra" if item["extra_runs"] else ""
    return (
        f"    {name:<16} {_maybe(item['mean'], '.4f')} ± {_maybe(item['sd'], '.4f')} "
        f"(n={item['n']}{extra})  {item['verdict']}"
    )


# ---- syncswitch policy -----------------------------------------------------------------------------


def policy_main(argv: list[str]) -> int:
    """``syncswitch policy next ...`` (argv excludes the word ``policy``); returns the exit status."""
    if not argv or argv[0] != "next":
        print("usage: syncswitch policy next --history FILE.jsonl [options]   (--help)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return _guarded("syncswitch policy next", _next, argv[1:])


def _next(argv: list[str]) -> int:
    args = build_policy_parser().parse_args(argv)
    config = timing_config(args)
    _require_file(args.history, "--history")
    try:
        records = read_jsonl(args.history)
    except RecordError as exc:
        raise UsageError(f"--history {args.history}: {exc}") from None
    fingerprint = args.fingerprint or newest_fingerprint(records)
    state = search_state(records, [], fingerprint or "", config, time.time())
    decision = state["decision"]
    same = sum(1 for r in records if r["fingerprint"] == fingerprint)
    print(
        f"{len(records)} record(s) in {args.history}, {same} with fingerprint {fingerprint or '(none)'}; "
        f"generation {state['generation']}",
        file=sys.stderr,
    )
    for generation in state["generations"]:
        print("\n".join(_generation_lines(generation)), file=sys.stderr)
    print(
        f"decision: bsp_fraction {decision['bsp_fraction']:g} ({decision['phase']}): {decision['reason']}",
        file=sys.stderr,
    )
    print(json.dumps({**decision, "fingerprint": fingerprint}), flush=True)
    return EXIT_OK


def newest_fingerprint(records: list[dict[str, Any]]) -> str | None:
    """The fingerprint of the record that completed last (None for an empty history)."""
    return max(records, key=completion_key)["fingerprint"] if records else None


# ---- shared ----------------------------------------------------------------------------------------


def _require_file(path: str, name: str) -> None:
    if not storage.exists(path):
        raise UsageError(f"{name}: no such file: {path}")


def _guarded(prog: str, command: Any, argv: list[str]) -> int:
    """Run a command; bad input becomes one line on stderr and exit 2."""
    try:
        return command(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
    except ValueError as exc:  # RecordError, RecordConflict, an unreadable stored record
        print(f"{prog}: error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT
