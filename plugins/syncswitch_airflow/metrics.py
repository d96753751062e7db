"""The pipeline's metrics: every name, its kind, unit and tags (``METRICS``), and the one place they
are sent from. docs/metrics.md is their table; a test keeps the two the same.

They go through Airflow's own ``Stats`` (``airflow.sdk.observability.stats``), so they reach whatever
the deployment's ``[metrics]`` section sends Airflow's metrics to (``statsd_on``, ``otel_on``,
``statsd_datadog_enabled``), under its prefix, and nowhere when it sends none (each call is then a
no-op). Tags travel as Airflow passes them: OpenTelemetry attributes, Datadog tags, or, for StatsD,
InfluxDB-style suffixes of the name with ``statsd_influxdb_enabled`` (a plain StatsD drops them).

Each is sent where the Airflow side knows its number: the segment trigger (or task) that records a
SegmentResult, the segment trigger's progress look and failure, the straggler sensor's decision,
the gce backend's revocation check, the finalize task, and every bucket call of an Airflow process
(``syncswitch.storage.on_retry``). Sending is a UDP datagram or an in-memory update, and never
raises: a metric must not fail the task or trigger that counts it.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from syncswitch import storage

log = logging.getLogger(__name__)

# What a tag value may hold: Airflow drops a whole stat whose name (with InfluxDB tags) has anything else.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge", "counter" or "timing" (milliseconds, as Airflow's own timings)
    unit: str
    tags: tuple[str, ...]
    where: str
    what: str


RUN_TAGS = ("dag_id", "job_name")
SEGMENT_TAGS = (*RUN_TAGS, "protocol", "segment")

SEGMENT_EXAMPLES_PER_SEC = Metric(
    "syncswitch.segment.examples_per_sec",
    "gauge",
    "examples/s",
    (*SEGMENT_TAGS, "origin"),
    "segment trigger (or task) recording its SegmentResult",
    "the segment's training throughput, first step to end (SegmentResult examples_per_sec)",
)
SEGMENT_DURATION = Metric(
    "syncswitch.segment.duration",
    "timing",
    "ms",
    (*SEGMENT_TAGS, "origin"),
    "same",
    "the segment's training time, first step to end",
)
SEGMENT_FAILED = Metric(
    "syncswitch.segment.failed",
    "counter",
    "tries",
    (*SEGMENT_TAGS, "node"),
    "segment trigger, on a failed try",
    "a try of the segment failed; node: the node that failed first (role-task), or none known",
)
SWITCH_GAP = Metric(
    "syncswitch.switch.gap",
    "timing",
    "ms",
    (*RUN_TAGS, "from_protocol", "to_protocol", "segment"),
    "segment trigger (or task) recording segment i > 0",
    "segment i-1's last step to segment i's first step (the report's switch gap)",
)
SWITCH_HANDOFF = Metric(
    "syncswitch.switch.handoff",
    "timing",
    "ms",
    (*RUN_TAGS, "from_protocol", "to_protocol", "segment"),
    "same",
    "the gap's first part: segment i-1's end to segment i's launcher start",
)
ONLINE_DECISIONS = Metric(
    "syncswitch.online.decisions",
    "counter",
    "decisions",
    (*SEGMENT_TAGS, "policy", "action", "change"),
    "straggler sensor, deciding on a verdict",
    "every decision of the online policy (action: stay, switch, switch_back; change: raised, "
    "cleared, ongoing)",
)
ONLINE_SWITCHES = Metric(
    "syncswitch.online.switches",
    "counter",
    "switches",
    (*SEGMENT_TAGS, "policy", "action"),
    "same, once the plan is rewritten",
    "an online switch made (action: switch to ASP, switch_back to BSP)",
)
CHECKPOINT_AGE = Metric(
    "syncswitch.checkpoint.age",
    "gauge",
    "s",
    SEGMENT_TAGS,
    "segment trigger, every progress look (2 s) while steps come",
    "seconds since the segment's newest checkpoint (before its first: since its first step, "
    "whose restored checkpoint the previous segment wrote at its end): what a failure now costs",
)
NODE_LOSSES = Metric(
    "syncswitch.cluster.node_losses",
    "counter",
    "nodes",
    (*SEGMENT_TAGS, "backend", "role", "outcome"),
    "segment trigger, as it reads the launcher's node_lost events",
    "a node ended before its segment (a lost host, a killed process; outcome: continues or fails)",
)
REVOCATIONS = Metric(
    "syncswitch.cluster.revocations",
    "counter",
    "VMs",
    ("job_name", "backend", "role", "preempted"),
    "gce backend's revocation check (every segment status poll)",
    "a VM of the run that Compute Engine no longer runs (preempted: a preemption notice came)",
)
REPLACEMENTS = Metric(
    "syncswitch.cluster.replacements",
    "counter",
    "VMs",
    ("job_name", "backend", "role", "outcome"),
    "gce backend, requesting and awaiting a replacement",
    "a revoked VM's replacement (outcome: requested, running, refused, failed)",
)
BUCKET_RETRIES = Metric(
    "syncswitch.bucket.retries",
    "counter",
    "retries",
    ("side", *SEGMENT_TAGS),
    "every bucket call of an Airflow process (side=airflow); segment record (side=chief)",
    "retried bucket calls: an Airflow process's own as they happen (no segment tags); a segment's "
    "chief's from its SegmentResult's bucket_retries, 0 included, once per segment",
)
RUN_FINISHED = Metric(
    "syncswitch.run.finished",
    "counter",
    "runs",
    (*RUN_TAGS, "status"),
    "finalize task",
    "a run's outcome recorded (status: success, failed)",
)
RUN_FINAL_ACCURACY = Metric(
    "syncswitch.run.final_accuracy",
    "gauge",
    "fraction",
    RUN_TAGS,
    "finalize task, on success",
    "the final checkpoint's test accuracy",
)
RUN_DURATION = Metric(
    "syncswitch.run.duration",
    "timing",
    "ms",
    (*RUN_TAGS, "status"),
    "finalize task",
    "the run's state created to finished",
)

METRICS = (
    SEGMENT_EXAMPLES_PER_SEC,
    SEGMENT_DURATION,
    SEGMENT_FAILED,
    SWITCH_GAP,
    SWITCH_HANDOFF,
    ONLINE_DECISIONS,
    ONLINE_SWITCHES,
    CHECKPOINT_AGE,
    NODE_LOSSES,
    REVOCATIONS,
    REPLACEMENTS,
    BUCKET_RETRIES,
    RUN_FINISHED,
    RUN_FINAL_ACCURACY,
    RUN_DURATION,
)


# ---- sending ---------------------------------------------------------------------------------------


def tags_of(metric: Metric, values: Mapping[str, Any]) -> dict[str, str]:
    """The metric's tags from ``values``: its own names only, each a safe string; a missing one is
    left out (Airflow's own metrics do the same with an unknown team)."""
    return {name: _UNSAFE.sub("_", str(values[name])) for name in metric.tags if values.get(name) is not None}


def send(metric: Metric, value: float, **tags: Any) -> None:
    """Send one value of ``metric``: a gauge's value, a counter's increment, a timing's seconds."""
    try:
        from airflow.sdk.observability import stats

        tagged = tags_of(metric, tags)
        if metric.kind == "gauge":
            stats.gauge(metric.name, float(value), tags=tagged)
        elif metric.kind == "counter":
            stats.incr(metric.name, int(value), tags=tagged)
        else:
            stats.timing(metric.name, datetime.timedelta(seconds=float(value)), tags=tagged)
    except Exception:  # noqa: BLE001 - never fail what is measured
        log.warning("could not send metric %s", metric.name, exc_info=True)


# ---- what the pipeline sends -------------------------------------------------------------------------


def segment_recorded(state: Mapping[str, Any], index: int, result: Mapping[str, Any], dag_id: str) -> None:
    """A segment's SegmentResult, recorded for the first time: its throughput and duration, the
    switch gap before it, and its chief's bucket retries."""
    entry = next((e for e in state.get("plan", []) if e.get("index") == index), {})
    tags = {
        "dag_id": dag_id,
        "job_name": state.get("job_name"),
        "protocol": result.get("protocol"),
        "segment": index,
        "origin": entry.get("origin"),
        "side": "chief",
    }
    if isinstance(result.get("examples_per_sec"), int | float):
        send(SEGMENT_EXAMPLES_PER_SEC, result["examples_per_sec"], **tags)
    if isinstance(result.get("seconds"), int | float):
        send(SEGMENT_DURATION, result["seconds"], **tags)
    send(BUCKET_RETRIES, int(result.get("bucket_retries") or 0), **tags)
    previous = state.get("segments", {}).get(str(index - 1))
    if index > 0 and previous:
        switch_gap(previous, result, {**tags, "from_protocol": previous.get("protocol")})


def switch_gap(previous: Mapping[str, Any], result: Mapping[str, Any], tags: dict[str, Any]) -> None:
    """The gap between ``previous``'s end and ``result``'s first step, and its hand-off part."""
    ended = previous.get("ended_at")
    tags = {**tags, "to_protocol": result.get("protocol")}
    if ended is None:
        return
    if result.get("first_step_at") is not None:
        send(SWITCH_GAP, float(result["first_step_at"]) - float(ended), **tags)
    if result.get("started_at") is not None:
        send(SWITCH_HANDOFF, float(result["started_at"]) - float(ended), **tags)


def checkpoint_age(seconds: float, **tags: Any) -> None:
    send(CHECKPOINT_AGE, max(seconds, 0.0), **tags)


def node_lost(event: Mapping[str, Any], **tags: Any) -> None:
    """One ``node_lost`` event of a segment's launcher."""
    role = str(event.get("node") or "").rsplit("-", 1)[0] or None
    outcome = "fails" if "fail" in str(event.get("outcome", "")) else "continues"
    send(NODE_LOSSES, 1, role=role, outcome=outcome, **tags)


def segment_failed(node: str | None, **tags: Any) -> None:
    send(SEGMENT_FAILED, 1, node=node or "none", **tags)


def decision(record: Mapping[str, Any], dag_id: str, job_name: str | None, *, switched: bool) -> None:
    """The online policy's decision (``record``: the sensor's decision record); a switch it made."""
    tags = {
        "dag_id": dag_id,
        "job_name": job_name,
        "protocol": record.get("protocol"),
        "segment": record.get("segment"),
        "policy": record.get("policy"),
        "action": record.get("action"),
        "change": record.get("change"),
    }
    send(ONLINE_DECISIONS, 1, **tags)
    if switched:
        send(ONLINE_SWITCHES, 1, **tags)


def run_finished(
    status: str, dag_id: str, job_name: str, accuracy: float | None, seconds: float | None
) -> None:
    tags = {"dag_id": dag_id, "job_name": job_name, "status": status}
    send(RUN_FINISHED, 1, **tags)
    if accuracy is not None:
        send(RUN_FINAL_ACCURACY, accuracy, **tags)
    if seconds is not None:
        send(RUN_DURATION, seconds, **tags)


def count_bucket_retries() -> None:
    """Count this process's retried bucket calls from now on (hooks.bucket, which every Airflow
    entry point to the bucket imports, calls it once)."""
    storage.on_retry(_bucket_retry)


def _bucket_retry(_what: str) -> None:
    send(BUCKET_RETRIES, 1, side="airflow")
