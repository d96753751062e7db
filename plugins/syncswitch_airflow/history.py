"""A recurring job's history: one immutable record per finished DAG run, one claim per started run.

Where (``syncswitch.layout.JobHistoryLayout``)::

    <bucket_dir>/_history/<job_name>/runs/<safe_run_id>.json     record, written when the run finishes
    <bucket_dir>/_history/<job_name>/claims.json                 {run_id: claim}, one per decided run

``bucket_dir`` is a local folder or a ``gs://`` URI (``syncswitch.storage``). The timing policy
(``syncswitch_airflow.timing``) reads both; ``syncswitch history`` shows them. The record format is
also the import format (one JSON object per line of a ``.jsonl`` file); docs/history.md describes
every field and the fingerprint.

Immutability: a record or claim, once written, is never replaced, with one exception: a failed run's
record gives way to the record the same run writes when it finishes again later (a failed run resumed
by clearing its failed tasks). Writing the same content again is a no-op (a retried task), other
different content for the same run id raises :class:`RecordConflict`. A record's check reads before it
writes; that is enough because the only writer of a run's record is that run. Claims are one
document updated atomically (``storage.update_json``), because a run decides from the other runs'
claims: :func:`claim_decision` decides and claims in one step. A reprocessed logical date is a new DAG
run with a new run id, so it gets its own record.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from syncswitch import storage
from syncswitch.errors import SpecError
from syncswitch.layout import JobHistoryLayout, safe_run_id
from syncswitch.protocols import PROTOCOLS, parse_switch_order, switch_order_text
from syncswitch.spec import _JOB_NAME_RE, JobSpec  # the one job-name rule, owned by the job spec

from syncswitch_airflow.timing import PHASES as DECISION_PHASES
from syncswitch_airflow.timing import completion_key

SCHEMA_VERSION = 1
STATUSES = ("success", "failed")
POLICY_PHASES = (*DECISION_PHASES, "fixed", "imported")
CLAIM_PHASES = (*DECISION_PHASES, "fixed")
REQUIRED_FIELDS = (
    "job_name",
    "run_id",
    "logical_date",
    "status",
    "bsp_fraction",
    "final_accuracy",
    "total_seconds",
    "training_seconds",
    "fingerprint",
    "policy_phase",
)
OPTIONAL_FIELDS = (
    "finished_at",
    "started_at",
    "switch_order",
    "dag_id",
    "workload_steps",
    "policy",
    "cost",
    "user_code",
    "schema_version",
)
CLAIM_FIELDS = ("run_id", "fingerprint", "bsp_fraction", "phase", "claimed_at")
# The job settings that change what accuracy a BSP fraction reaches (docs/history.md). Left out on
# purpose: switch_order, bsp_fraction and train_steps (what the policy varies; train_steps only counts
# through the workload), data_dir (may be templated per date), seed, bucket_dir, job_name and the
# online policy settings.
FINGERPRINT_FIELDS = (
    "model",
    "hparam_set",
    "problem",
    "num_workers",
    "workload_steps",
    "hparams",
    "momentum_rule",
    "momentum_ramp_steps",
)
FINGERPRINT_VERSION = 1
IMPORTED_PHASE = "imported"


class RecordError(ValueError):
    """A bad record, claim or import line. ``field`` names the field; ``line`` the import line, if any."""

    def __init__(self, field_name: str, message: str, line: int | None = None) -> None:
        prefix = f"line {line}: " if line is not None else ""
        super().__init__(f"{prefix}{field_name}: {message}")
        self.field = field_name
        self.line = line


class RecordConflict(ValueError):
    """A different record or claim already exists for this run id: history is immutable."""


# ---- fingerprint -----------------------------------------------------------------------------------


def job_fingerprint(params: Mapping[str, Any], user_code: str = "") -> str:
    """sha256 (first 16 hex digits) of the canonical JSON of :func:`fingerprint_settings`, with the
    job's user code (``syncswitch.usercode.identity``: its files' digest, its packages' versions) when
    it has any: a changed model is another configuration, whose switch point is searched afresh."""
    settings = fingerprint_settings(params)
    if user_code:
        settings["user_code"] = user_code
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def fingerprint_settings(params: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the fingerprint hashes, from a plain dict of JobSpec params (``JobSpec.to_params()``).

    Absent or empty settings take JobSpec's defaults, so a conf that leaves a default out and one that
    spells it out have the same fingerprint. The workload is ``sum(train_steps)`` when train_steps is
    given, else ``total_steps`` (``JobSpec.workload``).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(JobSpec)}

    def setting(name: str) -> Any:
        value = params.get(name)
        return defaults[name] if value is None or value == "" or value == [] or value == () else value

    train_steps = _as_list(setting("train_steps"))
    hparams = [str(h) for h in _as_list(setting("hparams"))] or [""]
    try:
        workload = sum(int(s) for s in train_steps) if train_steps else int(setting("total_steps"))
        num_workers = int(setting("num_workers"))
        ramp_steps = int(setting("momentum_ramp_steps"))
    except (TypeError, ValueError) as exc:
        raise RecordError(
            "fingerprint", f"job settings must be integers where JobSpec has them: {exc}"
        ) from None
    return {
        "fingerprint_version": FINGERPRINT_VERSION,
        "model": str(setting("model")),
        "hparam_set": str(setting("hparam_set")),
        "problem": str(setting("problem")),
        "num_workers": num_workers,
        "workload_steps": workload,
        "hparams": hparams,
        "momentum_rule": str(setting("momentum_rule")),
        "momentum_ramp_steps": ramp_steps,
    }


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        return value.split() if value.strip() else []
    return [value]


# ---- validation ------------------------------------------------------------------------------------


def check_job_name(job_name: Any) -> str:
    """The job name, if it is one; raises RecordError("job_name", ...) otherwise."""
    if not isinstance(job_name, str) or not _JOB_NAME_RE.match(job_name):
        raise RecordError(
            "job_name",
            f"{job_name!r} must be 1-63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit",
        )
    return job_name


def validate_record(record: Any) -> dict[str, Any]:
    """A checked copy of a history record; raises RecordError naming the first bad field.

    A record without ``finished_at`` gets 0 (it sorts before every timed record); one without
    ``schema_version`` gets 1.
    """
    if not isinstance(record, dict):
        raise RecordError("record", f"must be a JSON object, got {type(record).__name__}")
    _check_field_names(record, REQUIRED_FIELDS, OPTIONAL_FIELDS)
    out = dict(record)
    check_job_name(out["job_name"])
    for name, check in _RECORD_CHECKS.items():
        if name in out:
            out[name] = check(name, out[name])
    out.setdefault("finished_at", 0.0)
    out.setdefault("schema_version", SCHEMA_VERSION)
    return out


def validate_claim(claim: Any) -> dict[str, Any]:
    """A checked copy of a claim ``{run_id, fingerprint, bsp_fraction, phase, claimed_at}`` (and,
    optionally, ``decision``: the whole TimingDecision, so that a retried task reuses it)."""
    if not isinstance(claim, dict):
        raise RecordError("claim", f"must be a JSON object, got {type(claim).__name__}")
    _check_field_names(claim, CLAIM_FIELDS, ("decision", "protocol"))
    checked = {
        "run_id": _text("run_id", claim["run_id"]),
        "fingerprint": _text("fingerprint", claim["fingerprint"]),
        "bsp_fraction": _fraction("bsp_fraction", claim["bsp_fraction"]),
        "phase": _choice(CLAIM_PHASES)("phase", claim["phase"]),
        "claimed_at": _seconds("claimed_at", claim["claimed_at"]),
    }
    if "decision" in claim:
        checked["decision"] = _object("decision", claim["decision"])
    if "protocol" in claim:  # what the run trains after BSP (timing rule 10)
        checked["protocol"] = _text("protocol", claim["protocol"])
    return checked


def _check_field_names(data: dict, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    accepted = (*required, *optional)
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        raise RecordError(unknown[0], f"unknown field; accepted: {', '.join(accepted)}")
    missing = [name for name in required if name not in data]
    if missing:
        raise RecordError(missing[0], f"missing; required fields: {', '.join(required)}")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError(name, f"must be a number, got {value!r}")
    return float(value)


def _fraction(name: str, value: Any) -> float:
    number = _number(name, value)
    if not 0.0 <= number <= 1.0:
        raise RecordError(name, f"must be a number in [0, 1], got {value!r}")
    return number


def _seconds(name: str, value: Any) -> float:
    number = _number(name, value)
    if number < 0:
        raise RecordError(name, f"must be a number of seconds >= 0, got {value!r}")
    return number


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise RecordError(name, f"must be a non-empty string, got {value!r}")
    return value


def _choice(accepted: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in accepted:
            raise RecordError(name, f"{value!r} is not one of: {', '.join(accepted)}")
        return value

    return check


def _iso_date(name: str, value: Any) -> str:
    try:
        datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise RecordError(name, f"must be an ISO 8601 date-time string or null, got {value!r}") from None
    return value


def _training_seconds(name: str, value: Any) -> dict[str, float]:
    """Seconds per protocol: BSP's and ASP's always, the others' where the record has them (one
    written before they existed has not)."""
    if not isinstance(value, dict) or not {"bsp", "asp"} <= set(value) or set(value) - set(PROTOCOLS):
        raise RecordError(
            name,
            f'must be {{"bsp": seconds, "asp": seconds, ...}} of the protocols {PROTOCOLS}, got {value!r}',
        )
    return {key: _seconds(f"{name}.{key}", seconds) for key, seconds in value.items()}


def _switch_order(name: str, value: Any) -> str:
    """A switch order in its canonical text (syncswitch.protocols): "10", "bsp,ssp:4"."""
    try:
        return switch_order_text(parse_switch_order(value if isinstance(value, str) else None))
    except SpecError as err:
        raise RecordError(name, str(err).split(": ", 1)[1]) from None


def _steps(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecordError(name, f"must be an integer >= 1, got {value!r}")
    return value


def _object(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise RecordError(name, f"must be a JSON object or null, got {value!r}")
    return value


def _schema_version(name: str, value: Any) -> int:
    if value != SCHEMA_VERSION or isinstance(value, bool):
        raise RecordError(name, f"must be {SCHEMA_VERSION}, got {value!r}")
    return SCHEMA_VERSION


_RECORD_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "run_id": _text,
    "logical_date": _optional(_iso_date),
    "status": _choice(STATUSES),
    "bsp_fraction": _fraction,
    "final_accuracy": _optional(_fraction),
    "total_seconds": _optional(_seconds),
    "training_seconds": _training_seconds,
    "fingerprint": _text,
    "policy_phase": _choice(POLICY_PHASES),
    "finished_at": _seconds,
    "started_at": _optional(_seconds),
    "switch_order": _optional(_switch_order),
    "dag_id": _optional(_text),
    "workload_steps": _optional(_steps),
    "policy": _optional(_object),
    "cost": _optional(_object),
    "user_code": _optional(_object),
    "schema_version": _schema_version,
}


# ---- records and claims in the bucket ------------------------------------------------------------


def write_record(bucket_dir: str, job_name: str, record: dict[str, Any]) -> bool:
    """Write a finished run's record; True if written, False if the same record was already there.
    A failed run's record gives way to the record of the same run finishing later: a failed run
    resumed by clearing its failed tasks finishes again, and its history says how it ended."""
    record = validate_record(record)
    _check_same_job(job_name, record)
    uri = JobHistoryLayout.for_job(bucket_dir, job_name).record(record["run_id"])
    record = _as_stored(record)  # so that a retried write is a no-op
    existing = storage.read_json(uri, default=None)
    if existing == record:
        return False
    if existing is not None and not _resumed(existing, record):
        raise RecordConflict(
            f"run_id: a different entry for run {record['run_id']!r} already exists at {uri}; history "
            "is immutable (a reprocessed date is a new DAG run with its own run id)"
        )
    storage.write_json(uri, record)
    return True


def claim_decision(
    bucket_dir: str, job_name: str, run_id: str, decide: Callable[[list[dict[str, Any]]], dict[str, Any]]
) -> tuple[dict[str, Any], bool]:
    """This run's claim, deciding it atomically if the run has none yet; returns (claim, new).

    ``decide`` gets every claim of the job (oldest first) and returns this run's claim. Deciding and
    writing are one atomic update of the claims document, so overlapping runs (a backfill) always see
    each other's claims and never take the same item by accident. ``decide`` may be called more than
    once (a lost race on GCS decides again from the newer claims), so it must have no side effect.
    A retried task finds its own claim and reuses it (``new`` is False).
    """
    check_job_name(job_name)
    outcome: dict[str, Any] = {}

    def take(claims: dict[str, Any]) -> None:
        existing = claims.get(run_id)
        if existing is not None:
            outcome.update(claim=validate_claim(existing), new=False)
            return
        claim = validate_claim(decide(_sorted_claims(claims.values())))
        if claim["run_id"] != run_id:
            raise RecordError("run_id", f"the claim is for run {claim['run_id']!r}, not {run_id!r}")
        claims[run_id] = _as_stored(claim)
        outcome.update(claim=claim, new=True)

    storage.update_json(JobHistoryLayout.for_job(bucket_dir, job_name).claims, take)
    return outcome["claim"], outcome["new"]


def write_claim(bucket_dir: str, job_name: str, claim: dict[str, Any]) -> bool:
    """Write a started run's claim; True if written, False if the same claim was already there."""
    claim = validate_claim(claim)
    stored, new = claim_decision(bucket_dir, job_name, claim["run_id"], lambda _claims: claim)
    if not new and stored != _as_stored(claim):
        raise RecordConflict(
            f"run_id: a different claim for run {claim['run_id']!r} already exists; history is immutable "
            "(a reprocessed date is a new DAG run with its own run id)"
        )
    return new


def read_claim(bucket_dir: str, job_name: str, run_id: str) -> dict[str, Any] | None:
    """This run's claim, if it wrote one (a retried task reuses its decision rather than deciding again)."""
    claim = _claims_document(bucket_dir, job_name).get(run_id)
    return None if claim is None else validate_claim(claim)


def read_claims(bucket_dir: str, job_name: str) -> list[dict[str, Any]]:
    """Every claim of the job, checked, oldest first."""
    return _sorted_claims(_claims_document(bucket_dir, job_name).values())


def _claims_document(bucket_dir: str, job_name: str) -> dict[str, Any]:
    check_job_name(job_name)
    return storage.read_json(JobHistoryLayout.for_job(bucket_dir, job_name).claims, default={})


def _sorted_claims(claims: Iterable[Any]) -> list[dict[str, Any]]:
    return sorted((validate_claim(c) for c in claims), key=lambda c: (c["claimed_at"], c["run_id"]))


def _as_stored(content: dict[str, Any]) -> dict[str, Any]:
    """``content`` as its stored JSON reads back (tuples become lists), so equal means equal."""
    return json.loads(json.dumps(content, default=str))


def read_records(bucket_dir: str, job_name: str) -> list[dict[str, Any]]:
    """Every record of the job, checked, in completion order (finished_at, then run_id)."""
    check_job_name(job_name)
    folder = JobHistoryLayout.for_job(bucket_dir, job_name).records
    return sorted(_read_all(folder, validate_record), key=completion_key)


def _read_all(folder: str, validate: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    items = []
    for uri in storage.list_files(folder, suffix=".json"):
        try:
            items.append(validate(storage.read_json(uri)))
        except (RecordError, json.JSONDecodeError) as exc:
            raise ValueError(f"{uri}: {exc}") from None
    return items


def _check_same_job(job_name: str, record: dict[str, Any]) -> None:
    check_job_name(job_name)
    if record["job_name"] != job_name:
        raise RecordError("job_name", f"the record is of job {record['job_name']!r}, not {job_name!r}")


def _resumed(earlier: dict[str, Any], later: dict[str, Any]) -> bool:
    """``later`` is the same run finishing again after ``earlier`` recorded its failure."""
    return earlier.get("status") == "failed" and later["finished_at"] > float(earlier.get("finished_at") or 0)


# ---- JSON lines: import and export -------------------------------------------------------------------


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Checked records of a .jsonl file (local or gs://), in file order; errors name the line and field.

    Blank lines are skipped. A line without ``policy_phase`` gets "imported"; one without
    ``finished_at`` gets 0 (see :func:`validate_record`).
    """
    return [record for _number, record in _numbered_records(path)]


def _numbered_records(path: str) -> list[tuple[int, dict[str, Any]]]:
    records = []
    for number, line in enumerate(storage.read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(
                "json", f"not valid JSON ({exc.msg}, column {exc.colno})", line=number
            ) from None
        if isinstance(data, dict):
            data.setdefault("policy_phase", IMPORTED_PHASE)
        try:
            records.append((number, validate_record(data)))
        except RecordError as exc:
            raise RecordError(exc.field, str(exc).split(": ", 1)[1], line=number) from None
    return records


def write_jsonl(path: str, records: Iterable[dict[str, Any]]) -> None:
    """Write records as JSON lines (local or gs://), one compact object per line with sorted keys."""
    lines = [json.dumps(r, sort_keys=True, separators=(",", ":"), default=str) for r in records]
    storage.write_text(path, "".join(f"{line}\n" for line in lines))


def import_records(bucket_dir: str, job_name: str, jsonl_path: str) -> dict[str, int]:
    """Import a .jsonl history into the job: each line becomes its own immutable record.

    Every line is checked before anything is written, so a bad file imports nothing. Returns
    ``{"written": n, "unchanged": m}`` (unchanged: the identical record was already there).
    """
    check_job_name(job_name)
    numbered = _numbered_records(jsonl_path)
    _check_importable(job_name, numbered)
    written = sum(write_record(bucket_dir, job_name, record) for _number, record in numbered)
    return {"written": written, "unchanged": len(numbered) - written}


def _check_importable(job_name: str, numbered: list[tuple[int, dict[str, Any]]]) -> None:
    """Every record belongs to this job, and no run id comes twice with different content."""
    seen: dict[str, tuple[int, dict[str, Any]]] = {}
    for number, record in numbered:
        if record["job_name"] != job_name:
            raise RecordError("job_name", f"{record['job_name']!r} is not the job {job_name!r}", line=number)
        key = safe_run_id(record["run_id"])  # run ids that share a file name would overwrite each other
        if key in seen and seen[key][1] != record:
            raise RecordError(
                "run_id",
                f"{record['run_id']!r} differs from line {seen[key][0]}, which has the same run id "
                f"(file name {key}.json)",
                line=number,
            )
        seen.setdefault(key, (number, record))
