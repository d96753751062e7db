"""One storage layer for run folders, checkpoints and data: local paths and ``gs://`` URIs.

``gs://`` goes through google-cloud-storage rather than ``tf.io.gfile``: TF's GCS endpoint is
hard-coded, while google-cloud-storage honours ``STORAGE_EMULATOR_HOST``, so tests run the same code
path as production against a GCS emulator.

Writes are atomic at object granularity: local files are written to a temp file and renamed; GCS
object uploads are atomic by nature. :func:`update_json` is the one read-modify-write (run state,
a job's claims): serialised by an fcntl lock locally and by a generation precondition on GCS.

Bucket outages. Every ``gs://`` call goes through :func:`retrying`, the one retry owner (the client
library's own retries are switched off so that the limit below is the real one): a transient error
(connection refused or reset, timeouts, 429 and 5xx answers) is retried with exponential backoff for
up to ``$SYNCSWITCH_BUCKET_RETRY_SECONDS`` (300 s by default), with one log line when the bucket
becomes unreachable and one when it answers again. Past the limit, :class:`BucketUnavailable` is
raised: a segment then fails, and its retry resumes from the last complete checkpoint (a checkpoint
is complete only once its manifest, uploaded last, exists, so an outage never leaves a half-written
"latest"). Callers that must not block training on the bucket (event and TensorBoard uploads) pass
``retry_seconds=0`` and try again later themselves. Every retry is counted in the process
(:func:`retry_count`: a segment's chief reports its own in its result) and told to the listeners
of :func:`on_retry` (the Airflow side counts its own as a metric).
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import functools
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

GS_PREFIX = "gs://"
RETRY_SECONDS_ENV = "SYNCSWITCH_BUCKET_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 300.0
# Per request: a hung connection counts as a failed attempt after this long.
REQUEST_TIMEOUT_SECONDS = 60.0
_FIRST_BACKOFF_SECONDS = 0.5
_MAX_BACKOFF_SECONDS = 15.0

log = logging.getLogger(__name__)
T = TypeVar("T")

# Where gs:// calls get their client within a block of client_from(): the Airflow side builds it from
# an Airflow connection; training nodes never set it and use the plain client. A context variable,
# not a module variable: a block ends cleanly (in-process dag.test() runs one task after another),
# and a thread pool that must use it copies the context per call (see carry_context).
_client_source: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar(
    "syncswitch_gcs_client_source", default=None
)


# Retries of this process (every retrying() call, every thread) and who hears of each one.
_retries = 0
_retries_lock = threading.Lock()
_retry_listeners: list[Callable[[str], None]] = []


def retry_count() -> int:
    """How many bucket calls this process has retried so far (each retry of each call counts)."""
    return _retries


def on_retry(listener: Callable[[str], None]) -> None:
    """Call ``listener(what)`` at every retry of a bucket call from now on (once per listener: a
    module imported twice registers once). A listener's error is logged, never the call's."""
    if listener not in _retry_listeners:
        _retry_listeners.append(listener)


def _count_retry(what: str) -> None:
    global _retries
    with _retries_lock:
        _retries += 1
    for listener in list(_retry_listeners):
        try:
            listener(what)
        except Exception:  # noqa: BLE001 - a metric must not fail the bucket call it counts
            log.exception("bucket retry listener %r failed", listener)


class BucketUnavailable(RuntimeError):
    """The bucket did not answer within the retry limit; the message says what failed and since when."""


def is_remote(uri: str) -> bool:
    return uri.startswith(GS_PREFIX)


def split_gs(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``."""
    rest = uri[len(GS_PREFIX) :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"not a gs:// URI with a bucket: {uri!r}")
    return bucket, key


@functools.lru_cache(maxsize=4)
def _client(emulator_host: str | None, project: str | None):  # noqa: ANN202 - google type
    from google.cloud import storage as gcs

    if emulator_host:
        from google.auth.credentials import AnonymousCredentials

        return gcs.Client(project=project or "test", credentials=AnonymousCredentials())
    return gcs.Client(project=project)


def gcs_client():  # noqa: ANN201 - google type
    """The google-cloud-storage client of this context: the one of the enclosing :func:`client_from`
    block, else :func:`default_client`."""
    source = _client_source.get()
    return source() if source is not None else default_client()


def default_client():  # noqa: ANN201 - google type
    """The client of the default credentials (anonymous against an emulator, ``STORAGE_EMULATOR_HOST``)."""
    return _client(os.environ.get("STORAGE_EMULATOR_HOST"), os.environ.get("GOOGLE_CLOUD_PROJECT"))


@contextlib.contextmanager
def client_from(make_client: Callable[[], Any]) -> Iterator[None]:
    """Within the block, every ``gs://`` call uses the client ``make_client()`` returns, made once, on
    the first call that needs it (a block that touches no bucket builds none)."""
    made: list[Any] = []

    def client() -> Any:
        if not made:
            made.append(make_client())
        return made[0]

    token = _client_source.set(client)
    try:
        yield
    finally:
        _client_source.reset(token)


def carry_context(call: Callable[..., T]) -> Callable[..., T]:
    """``call``, to run once in a copy of the caller's context (its storage client among it): for a
    thread pool, one per submitted call, ``pool.submit(carry_context(f), x)``. A pool's threads start
    with an empty context otherwise, and one copy cannot be entered by two threads at once."""
    return functools.partial(contextvars.copy_context().run, call)


def submit_each(pool: Executor, call: Callable[[Any], T], items: Iterable[Any]) -> list[Future[T]]:
    """``pool.submit(call, item)`` for each item, each in its own copy of the caller's context."""
    return [pool.submit(carry_context(call), item) for item in items]


def _blob(uri: str):  # noqa: ANN202
    bucket, key = split_gs(uri)
    return gcs_client().bucket(bucket).blob(key)


# --- retries ----------------------------------------------------------------------------------


def retry_limit() -> float:
    """Seconds a bucket call keeps retrying transient errors (``$SYNCSWITCH_BUCKET_RETRY_SECONDS``)."""
    raw = os.environ.get(RETRY_SECONDS_ENV)
    return float(raw) if raw else DEFAULT_RETRY_SECONDS


def is_transient(exc: BaseException) -> bool:
    """An error worth retrying: the bucket is unreachable or overloaded, not the request wrong.
    The same classes google-cloud-storage retries by default (google.cloud.storage.retry)."""
    import http.client

    import requests
    import urllib3
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth

    transient = (
        api.TooManyRequests,
        api.InternalServerError,
        api.BadGateway,
        api.ServiceUnavailable,
        api.GatewayTimeout,
        ConnectionError,
        TimeoutError,
        requests.ConnectionError,
        requests.exceptions.ChunkedEncodingError,
        requests.exceptions.Timeout,
        http.client.BadStatusLine,
        http.client.IncompleteRead,
        http.client.ResponseNotReady,
        urllib3.exceptions.PoolError,
        urllib3.exceptions.ProtocolError,
        urllib3.exceptions.TimeoutError,
    )
    if isinstance(exc, transient):
        return True
    if isinstance(exc, api.GoogleAPICallError):
        return exc.code in (408, 429, 500, 502, 503, 504)
    if isinstance(exc, auth.TransportError):
        return bool(exc.args) and isinstance(exc.args[0], BaseException) and is_transient(exc.args[0])
    response = getattr(exc, "response", None)  # google.resumable_media's InvalidResponse
    return getattr(response, "status_code", None) in (408, 429, 500, 502, 503, 504)


def retrying(what: str, call: Callable[[], T], *, retry_seconds: float | None = None) -> T:
    """``call()``, retrying transient bucket errors with backoff for up to ``retry_seconds``
    (default :func:`retry_limit`); raises BucketUnavailable past it. ``what`` names the call in logs."""
    limit = retry_limit() if retry_seconds is None else retry_seconds
    started = time.monotonic()
    delay, failures = _FIRST_BACKOFF_SECONDS, 0
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            waited = time.monotonic() - started
            if waited + delay > limit:
                raise BucketUnavailable(
                    f"{what}: the bucket did not answer for {waited:.0f} s (limit {limit:.0f} s, "
                    f"${RETRY_SECONDS_ENV}): {type(exc).__name__}: {exc}"
                ) from exc
            if failures == 0:
                log.warning(
                    "bucket unreachable: %s failed (%s); retrying with backoff for up to %.0f s",
                    what,
                    type(exc).__name__,
                    limit,
                )
            failures += 1
            _count_retry(what)
            time.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF_SECONDS)
            continue
        if failures:
            log.warning(
                "bucket reachable again: %s succeeded after %.0f s (%d retries)",
                what,
                time.monotonic() - started,
                failures,
            )
        return result


def _gcs(what: str, uri: str, call: Callable[[], T], retry_seconds: float | None = None) -> T:
    return retrying(f"{what} {uri}", call, retry_seconds=retry_seconds)


# The client's own retries are off (retry=None): retrying() above is the one owner of the limit.
_NO_RETRY: dict[str, Any] = {"retry": None, "timeout": REQUEST_TIMEOUT_SECONDS}


# --- single objects -------------------------------------------------------------------------


def read_bytes(uri: str) -> bytes:
    if is_remote(uri):
        return _gcs("read", uri, lambda: _blob(uri).download_as_bytes(**_NO_RETRY))
    with open(uri, "rb") as f:
        return f.read()


def read_bytes_from(uri: str, offset: int) -> bytes:
    """The bytes of an object from ``offset`` on (b"" when it is no longer than that)."""
    if is_remote(uri):

        def ranged() -> bytes:
            blob = _blob(uri)
            blob.reload(**_NO_RETRY)
            if (blob.size or 0) <= offset:
                return b""
            return blob.download_as_bytes(start=offset, **_NO_RETRY)

        return _gcs("read", uri, ranged)
    with open(uri, "rb") as f:
        f.seek(offset)
        return f.read()


def read_text(uri: str, default: str | None = None) -> str:
    """Read a text object; return ``default`` if it does not exist (raise if default is None)."""
    try:
        return read_bytes(uri).decode("utf-8")
    except (FileNotFoundError, _not_found_error()):
        if default is None:
            raise
        return default


_MISSING = object()


def read_json(uri: str, default: Any = _MISSING) -> Any:
    """Parsed JSON; ``default`` (if given) when the object does not exist or is empty."""
    text = read_text(uri, default=None if default is _MISSING else "")
    if not text:
        if default is _MISSING:
            raise FileNotFoundError(uri)
        return default
    return json.loads(text)


def write_bytes(uri: str, data: bytes, *, retry_seconds: float | None = None) -> None:
    if is_remote(uri):
        _gcs("write", uri, lambda: _blob(uri).upload_from_string(data, **_NO_RETRY), retry_seconds)
        return
    directory = os.path.dirname(uri) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        # mkstemp creates 0600; run folders are read by other users (a UI, a report viewer).
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, uri)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def create_private(uri: str, data: bytes) -> bytes:
    """Create the object with ``data`` unless it exists, atomically (the first writer wins: a
    generation-0 precondition on GCS, O_EXCL with mode 0600 locally); returns what it holds.

    For a run's cluster secrets (its SSH key, its fork servers' token): every Airflow worker of a
    deployment gets the same one, and no one but the bucket's readers (locally: the owner) sees it."""
    if is_remote(uri):
        from google.api_core.exceptions import PreconditionFailed

        with contextlib.suppress(_not_found_error()):
            return read_bytes(uri)  # made already: every call after the first (each segment launch)

        def create() -> None:
            with contextlib.suppress(PreconditionFailed):
                _blob(uri).upload_from_string(data, if_generation_match=0, **_NO_RETRY)

        _gcs("create", uri, create)
        return read_bytes(uri)
    os.makedirs(os.path.dirname(uri) or ".", exist_ok=True)
    try:
        fd = os.open(uri, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_bytes(uri)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return data


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def update_json(uri: str, mutate: Callable[[Any], Any], *, attempts: int = 20) -> Any:
    """Read-modify-write one JSON document atomically; returns the document as written.

    ``mutate`` gets the current document (``{}`` when there is none) and changes it in place. It may
    run more than once (a lost race on GCS re-reads and re-applies it), so it must not act outside the
    document. Concurrent writers are serialised: an fcntl lock beside a local file, a generation
    precondition on a GCS object.
    """
    if is_remote(uri):
        return _update_gcs(uri, mutate, attempts)
    return _update_local(uri, mutate)


def _update_local(path: str, mutate: Callable[[Any], Any]) -> Any:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            document = read_json(path, default={})
            mutate(document)
            write_json(path, document)
            return document
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _update_gcs(uri: str, mutate: Callable[[Any], Any], attempts: int) -> Any:
    from google.api_core.exceptions import PreconditionFailed

    for attempt in range(attempts):
        try:
            # A transient outage is retried inside (retrying); a lost race comes out here.
            return retrying(f"update {uri}", lambda: _update_gcs_once(uri, mutate))
        except PreconditionFailed:  # another writer won (between reload and download, or on upload)
            # Jitter so that writers that lost together do not retry in lockstep.
            time.sleep(random.uniform(0.01, 0.05 * (attempt + 1)))
    raise RuntimeError(f"{uri} changed under {attempts} concurrent updates")


def _update_gcs_once(uri: str, mutate: Callable[[Any], Any]) -> Any:
    """One read-modify-write guarded by the object's generation (0 = must not exist yet)."""
    # A fresh Blob per attempt: reload() stores the generation it saw, and a reused Blob would
    # pin the next attempt's reads to that stale generation (NotFound -> {} -> 412 forever).
    blob_ref = _blob(uri)
    generation = 0
    document: Any = {}
    with contextlib.suppress(_not_found_error()):
        blob_ref.reload(retry=None)
        generation = blob_ref.generation
        document = json.loads(blob_ref.download_as_bytes(if_generation_match=generation, retry=None))
    mutate(document)
    blob_ref.upload_from_string(
        json.dumps(document, indent=2, sort_keys=True, default=str),
        content_type="application/json",
        if_generation_match=generation,
        retry=None,
    )
    return document


def exists(uri: str) -> bool:
    if is_remote(uri):
        return _gcs("look up", uri, lambda: _blob(uri).exists(**_NO_RETRY))
    return os.path.exists(uri)


def delete(uri: str) -> None:
    if is_remote(uri):

        def delete_if_there() -> None:
            try:
                _blob(uri).delete(**_NO_RETRY)
            except _not_found_error():
                pass  # gone already (or an earlier attempt's answer was lost)

        _gcs("delete", uri, delete_if_there)
    elif os.path.isdir(uri):
        shutil.rmtree(uri, ignore_errors=True)
    elif os.path.exists(uri):
        os.unlink(uri)


def upload_file(local_path: str, uri: str, *, retry_seconds: float | None = None) -> None:
    if is_remote(uri):
        _gcs("upload", uri, lambda: _blob(uri).upload_from_filename(local_path, **_NO_RETRY), retry_seconds)
        return
    with open(local_path, "rb") as f:
        write_bytes(uri, f.read())


def download_file(uri: str, local_path: str) -> None:
    os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
    if is_remote(uri):
        _gcs("download", uri, lambda: _blob(uri).download_to_filename(local_path, **_NO_RETRY))
    else:
        shutil.copyfile(uri, local_path)


# --- prefixes (folders) -----------------------------------------------------------------------


def list_files(prefix: str, suffix: str = "") -> list[str]:
    """Every file (object) below ``prefix``, recursively, as full URIs/paths, sorted."""
    if is_remote(prefix):
        return sorted(u for u in _gcs("list", prefix, lambda: list(_walk_gcs(prefix))) if u.endswith(suffix))
    return sorted(u for u in _walk_local(prefix) if u.endswith(suffix))


def file_sizes(prefix: str, suffix: str = "") -> dict[str, int]:
    """``list_files``'s files with their sizes in bytes, from one listing."""
    if is_remote(prefix):
        sized = _gcs("list", prefix, lambda: list(_walk_gcs_sized(prefix)))
    else:
        sized = [(path, os.path.getsize(path)) for path in _walk_local(prefix)]
    return {uri: size for uri, size in sorted(sized) if uri.endswith(suffix)}


def _walk_gcs(prefix: str) -> Iterator[str]:
    return (uri for uri, _size in _walk_gcs_sized(prefix))


def _walk_gcs_sized(prefix: str) -> Iterator[tuple[str, int]]:
    bucket, key = split_gs(prefix)
    key = key.rstrip("/") + "/" if key else ""
    for blob in gcs_client().list_blobs(bucket, prefix=key, **_NO_RETRY):
        yield f"{GS_PREFIX}{bucket}/{blob.name}", blob.size or 0


def _walk_local(prefix: str) -> Iterator[str]:
    if not os.path.isdir(prefix):
        return
    for dirpath, _dirs, files in os.walk(prefix):
        for name in files:
            if not name.startswith(".tmp-"):
                yield os.path.join(dirpath, name)


def list_dirs(prefix: str) -> list[str]:
    """Immediate child folder names below ``prefix``."""
    if is_remote(prefix):
        bucket, key = split_gs(prefix)
        key = key.rstrip("/") + "/" if key else ""

        def child_prefixes() -> list[str]:
            iterator = gcs_client().list_blobs(bucket, prefix=key, delimiter="/", **_NO_RETRY)
            list(iterator)  # the prefixes are filled in while pages are consumed
            return sorted(p[len(key) :].rstrip("/") for p in iterator.prefixes)

        return _gcs("list", prefix, child_prefixes)
    if not os.path.isdir(prefix):
        return []
    return sorted(d for d in os.listdir(prefix) if os.path.isdir(os.path.join(prefix, d)))


def upload_dir(local_dir: str, uri: str, *, retry_seconds: float | None = None) -> list[str]:
    """Copy every file of a local folder below ``uri``; returns the relative names copied."""
    names = []
    for dirpath, _dirs, files in os.walk(local_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, local_dir)
            upload_file(path, f"{uri.rstrip('/')}/{rel}", retry_seconds=retry_seconds)
            names.append(rel)
    return sorted(names)


def download_dir(uri: str, local_dir: str) -> list[str]:
    """Copy every file below ``uri`` into a local folder; returns the relative names copied."""
    base = uri.rstrip("/") + "/"
    names = []
    for file_uri in list_files(uri):
        rel = file_uri[len(base) :]
        download_file(file_uri, os.path.join(local_dir, rel))
        names.append(rel)
    return sorted(names)


def delete_prefix(uri: str) -> None:
    if is_remote(uri):
        for file_uri in list_files(uri):
            delete(file_uri)
    else:
        shutil.rmtree(uri, ignore_errors=True)


def _not_found_error() -> type[Exception]:
    from google.api_core.exceptions import NotFound

    return NotFound
