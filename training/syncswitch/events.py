"""The metrics contract: JSON-lines events that every training process appends to the run folder.

Every event is one JSON object per line with these common keys:

    event       one of EVENT_TYPES
    run_id      the run folder's run id
    segment     segment index (0, 1, ...)
    protocol    one of syncswitch.protocols.PROTOCOLS: bsp, asp, ssp, local, cbsp
    role        "chief", "worker", "ps", or "launcher" (the local supervisor: straggler events)
    task        task index within the role
    wall_time   seconds since the epoch when the event was emitted

Per event type, the extra keys are:

    segment_start  protocol_args (the protocol's settings: syncswitch.protocols), start_step,
                   until_step, num_workers, batch_per_worker, learning_rate, momentum,
                   momentum_rule, optimizer, second_moment_scale (Adam's v at the switch: spec),
                   weight_decay,
                   steps_per_execution (0 = automatic), restored_from
                   (checkpoint uri or None), checkpoint_digest (from its
                   manifest) and restored_digest (of the restored weights): equal on an exact handoff
    step           (the chief only: the ASP coordinator, BSP worker 0) global_step (BSP-equivalent
                   steps, float), samples, updates, loss, examples_per_sec, step_time, learning_rate, momentum
    worker_step    per-worker timing, the straggler detector's input: worker, global_step, steps
                   (averaged over), step_time (s per step of this worker), compute_time (this worker's
                   own share of a step: BSP = step_time minus the time blocked waiting for peers in
                   the collectives, so input, compute and a frozen process all count; ASP = the
                   closure's forward and backward pass on the worker), wait_time (BSP: waiting for
                   peers; ASP: the rest of the closure, i.e. the PS round trip), bytes_sent (per
                   step: what this worker handed to the network, counted from the tensors sent;
                   syncswitch.exchange), clock_lead (SSP: the largest lead of the worker's clock over
                   the slowest worker's that a step of the window started with; never above the
                   bound s), peer_rtt (all-reduce protocols, when measured: the worker's smallest
                   TCP round trip to a peer, s; syncswitch.peers)
    checkpoint     global_step, samples, uri, seconds
    eval           global_step, test_accuracy, test_loss (and seconds: how long it took, for an
                   evaluation at a checkpoint during training)
    straggler      injected slow episode: worker, kind (cpu | network), slowdown (cpu) or delay_ms
                   (network, per round trip), start, end (epoch seconds)
    watchdog       worker, reason (a stalled worker was killed)
    node_lost      node (e.g. worker-1), host (its host's name; null on the launcher's own), exit_code,
                   global_step (the chief's, when the launcher saw it), outcome (what followed: ASP
                   continues with the survivors, or the segment fails); written by the launcher
    segment_failed reason, node (the node that failed first, or null: syncswitch.launcher.first_failed),
                   host, exit_code, lost (its host or fork server stopped answering), global_step,
                   last_lines (its log's), log (its log in the run folder), logs (every node's);
                   written by the launcher as the segment fails
    steps_per_execution  steps (optimizer steps per ASP closure / BSP call, chosen automatically),
                   step_seconds (the measured time of one step behind the choice)
    average        (local SGD's chief) global_step (where the replicas were averaged), steps (since
                   the average before), bytes (of the state vector each worker all-reduced)
    segment_end    global_step, samples, updates, seconds, examples_per_sec, stopped_early, reason
    hook_error     (the chief) hook, method (on_checkpoint | on_evaluate), step, error, where (the
                   file:line that raised): a user's hook failed, training went on (syncswitch.hooks)
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from syncswitch import storage

log = logging.getLogger(__name__)

EVENT_TYPES = (
    "segment_start",
    "step",
    "worker_step",
    "checkpoint",
    "eval",
    "straggler",
    "watchdog",
    "node_lost",
    "segment_failed",
    "steps_per_execution",
    "average",
    "segment_end",
    "hook_error",
)


PART_BYTES = 4 * 1024 * 1024  # an event file's size before its writer goes on in a new part
STREAM_BYTES = 64 * 1024 * 1024  # what one process's finished parts may hold in all
# High-rate timings, thinned in old parts to keep a stream under STREAM_BYTES; every other event
# (segment start and end, checkpoints, evaluations, stragglers...) is kept whole.
THINNED_EVENTS = ("worker_step", "step")
# A thinned part keeps at least this many of them (about 1 kB, 1/4000 of a part), so no stretch of a
# run's history vanishes: a stream is bounded by STREAM_BYTES plus that much per part.
MIN_TIMINGS_PER_PART = 4
_THINNED_PREFIXES = tuple(f'{{"event": "{name}"'.encode() for name in THINNED_EVENTS)


def part_uri(uri: str, part: int) -> str:
    """The ``part``-th file of an event stream: ``chief-0.jsonl``, then ``chief-0.part0001.jsonl``..."""
    if part == 0:
        return uri
    base, ext = os.path.splitext(uri)
    return f"{base}.part{part:04d}{ext}"


def _parts(uri: str) -> list[int]:
    """The part numbers of stream ``uri`` that files hold, in order."""
    folder, name = uri.rsplit("/", 1)
    stem = re.escape(os.path.splitext(name)[0])
    pattern = re.compile(rf"{stem}(?:\.part(\d{{4}}))?\.jsonl")
    return sorted(
        int(match.group(1) or 0)
        for path in storage.list_files(folder, ".jsonl")
        if path.rsplit("/", 1)[0] == folder and (match := pattern.fullmatch(path.rsplit("/", 1)[1]))
    )


def _next_part(uri: str) -> int:
    """The first part number of stream ``uri`` that no file holds yet."""
    parts = _parts(uri)
    return parts[-1] + 1 if parts else 0


def read_stream(uri: str, *, event: str | None = None) -> list[dict[str, Any]]:
    """The events of one process's stream ``uri``, every part of it (a retried launcher writes on in
    a new part), in the order written."""
    return [
        record
        for part in _parts(uri)
        for record in parse_lines(storage.read_text(part_uri(uri, part), default=""))
        if event is None or record.get("event") == event
    ]


class EventWriter:
    """Appends events for one process.

    Local run folders are appended to in place. For ``gs://`` folders (objects cannot be appended
    to) events go to a local file that a background thread uploads whole, at most every
    ``flush_seconds``; ``close()`` uploads the last time. Training never waits for the bucket: during
    an outage the uploader logs once, keeps every event in the local file and tries again later.

    A stream goes on in a new part file (``part_uri``) once its current one holds ``part_bytes``, so
    a flush of a days-long job uploads one part (and a thinned one now and then), and no event file
    grows without bound. Nor does the stream: once its finished parts hold more than
    ``stream_bytes``, every other high-rate timing event (``THINNED_EVENTS``) is dropped from the
    oldest finished parts first (down to MIN_TIMINGS_PER_PART each), again at every new part while
    needed: recent history stays whole and the oldest is the most thinned, as TensorBoard
    downsamples long scalar series. Thinning rewrites a finished part in place (and uploads it
    again); a reader that was part-way into that part (more than a part behind) may see a few events
    twice. Readers take every ``.jsonl`` of a folder.
    """

    def __init__(
        self,
        uri: str,
        *,
        run_id: str,
        segment: int,
        protocol: str,
        role: str,
        task: int,
        flush_seconds: float = 2.0,
        part_bytes: int = PART_BYTES,
        stream_bytes: int = STREAM_BYTES,
    ) -> None:
        self.uri = uri
        self._common = {
            "run_id": run_id,
            "segment": segment,
            "protocol": protocol,
            "role": role,
            "task": task,
        }
        self._lock = threading.Lock()
        self._remote = storage.is_remote(uri)
        # A local stream is appended to in place; a bucket object cannot be, so a writer for a stream
        # that exists already (a retried segment's process, the launcher of a rerun) goes on in a
        # new part after the last one instead of overwriting what earlier writers uploaded.
        first_part = _next_part(uri) if self._remote else 0
        self._part, self._part_bytes, self._stream_bytes = first_part, part_bytes, stream_bytes
        self._closed: list[tuple[str, str]] = []  # (local file, uri) of every finished part, oldest first
        self._finished: list[tuple[str, str]] = []  # (local file, uri) of remote parts to upload again
        self._open_part()
        self._flush_seconds = flush_seconds
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._uploader: threading.Thread | None = None
        if self._remote:
            self._uploader = threading.Thread(target=self._upload_loop, name="event-upload", daemon=True)
            self._uploader.start()

    def _open_part(self) -> None:
        self._uri = part_uri(self.uri, self._part)
        if self._remote:
            fd, self._local_path = tempfile.mkstemp(prefix="events-", suffix=".jsonl")
            os.close(fd)
        else:
            self._local_path = self._uri
            os.makedirs(os.path.dirname(self._uri) or ".", exist_ok=True)
        self._file = open(self._local_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._written = self._file.tell()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        if event not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event!r}; expected one of {EVENT_TYPES}")
        record = {"event": event, **self._common, "wall_time": time.time(), **fields}
        line = json.dumps(record, default=float) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            self._written += len(line)
            if self._written >= self._part_bytes:
                self._file.close()
                self._closed.append((self._local_path, self._uri))
                if self._remote:
                    self._finished.append((self._local_path, self._uri))
                self._part += 1
                self._open_part()
                self._thin_closed_parts()
        self._dirty.set()
        return record

    def _thin_closed_parts(self) -> None:
        """Halve the timing events of finished parts, oldest first, until they fit ``stream_bytes``
        (or hold nothing more to thin). Called under the lock, once per new part."""
        total = sum(os.path.getsize(local) for local, _ in self._closed)
        while total > self._stream_bytes:
            thinned = False
            for part in self._closed:
                if total <= self._stream_bytes:
                    break
                before = os.path.getsize(part[0])
                if _thin_file(part[0]):
                    thinned = True
                    total -= before - os.path.getsize(part[0])
                    if self._remote and part not in self._finished:
                        self._finished.append(part)
            if not thinned:
                return

    def _upload_loop(self) -> None:
        failing = False
        while not self._closing.is_set():
            if not self._dirty.wait(timeout=1.0):
                continue
            self._dirty.clear()
            try:
                self._upload(retry_seconds=0)
            except storage.BucketUnavailable as exc:
                self._dirty.set()  # still to upload
                if not failing:
                    log.warning("events of %s not uploaded yet, kept locally: %s", self.uri, exc)
                failing = True
            else:
                if failing:
                    log.warning("events of %s uploaded again", self.uri)
                failing = False
            self._closing.wait(self._flush_seconds)

    def _upload(self, retry_seconds: float | None = None) -> None:
        """Finished parts once each (then their local copy goes), then the current part."""
        with self._lock:
            finished, current = list(self._finished), (self._local_path, self._uri)
        for local, uri in finished:
            version = os.stat(local).st_mtime_ns
            storage.upload_file(local, uri, retry_seconds=retry_seconds)
            with self._lock:
                if os.stat(local).st_mtime_ns == version:  # else thinned meanwhile: upload it again
                    self._finished.remove((local, uri))
        storage.upload_file(*current, retry_seconds=retry_seconds)

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
        if self._remote:
            self._closing.set()
            self._uploader.join()
            self._upload()  # the last upload waits out an outage
            for local in [self._local_path, *(local for local, _ in self._closed)]:
                os.unlink(local)

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _thin_file(path: str) -> bool:
    """Drop every other timing event of a finished part holding more than MIN_TIMINGS_PER_PART of
    them; True if any went."""
    with open(path, "rb") as f:
        lines = f.readlines()
    timings = [i for i, line in enumerate(lines) if line.startswith(_THINNED_PREFIXES)]
    if len(timings) <= MIN_TIMINGS_PER_PART:
        return False
    dropped = set(timings[1::2][: len(timings) - MIN_TIMINGS_PER_PART])
    kept = b"".join(line for i, line in enumerate(lines) if i not in dropped)
    temporary = f"{path}.thinning"
    with open(temporary, "wb") as f:
        f.write(kept)
    os.replace(temporary, path)  # a reader sees the old part or the thinned one, never half of it
    return True


def parse_lines(text: str) -> Iterator[dict[str, Any]]:
    """Parse JSON lines, skipping a torn last line (a writer may be mid-append)."""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


class EventTail:
    """The one incremental reader of event files: each ``read_new()`` returns the complete lines
    appended to a folder's ``.jsonl`` files since the last call, sorted by wall time.

    Every watcher reads events through it (the segment trigger's progress and stall check, the
    straggler trigger, ``syncswitch run``'s progress lines), so they agree on what a run has done.
    Local files are read from the last offset; ``gs://`` objects (re-uploaded whole by their writer)
    are read from the same offset with a ranged download. A torn last line (a writer mid-append) is
    kept for the next call. A folder that does not exist yet reads as empty.
    """

    def __init__(self, folder: str, offsets: dict[str, int] | None = None) -> None:
        self.folder = folder
        self.offsets: dict[str, int] = dict(offsets or {})

    def skip_existing(self) -> dict[str, int]:
        """Read on only what is appended from now on (a retry's events, not its killed try's);
        returns the offsets, for a reader that goes on elsewhere (``EventTail(folder, offsets)``)."""
        self.offsets = storage.file_sizes(self.folder, suffix=".jsonl")
        return dict(self.offsets)

    def read_new(self, event: str | None = None) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for uri in storage.list_files(self.folder, suffix=".jsonl"):
            offset = self.offsets.get(uri, 0)
            chunk = storage.read_bytes_from(uri, offset)
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[uri] = offset + len(complete)
            records.extend(
                r
                for r in parse_lines(complete.decode("utf-8", errors="replace"))
                if event is None or r.get("event") == event
            )
        records.sort(key=lambda r: r.get("wall_time", 0.0))
        return records


def read_events(metrics_uri: str, *, event: str | None = None) -> list[dict[str, Any]]:
    """All events under a metrics folder (a whole run, or one segment), sorted by wall time."""
    records: list[dict[str, Any]] = []
    for uri in storage.list_files(metrics_uri, suffix=".jsonl"):
        text = storage.read_text(uri, default="")
        records.extend(r for r in parse_lines(text) if event is None or r.get("event") == event)
    records.sort(key=lambda r: r.get("wall_time", 0.0))
    return records
