"""One storage layer for run folders, checkpoints and data: local paths and ``gs://`` URIs.

``gs://`` goes through google-cloud-storage rather than ``tf.io.gfile``: TF's GCS endpoint is
hard-coded, while google-cloud-storage honours ``STORAGE_EMULATOR_HOST``, so tests run the same code
path as production against a GCS emulator.

Writes are atomic at object granularity: local files are written to a temp file and renamed; GCS
object uploads are atomic by nature.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

GS_PREFIX = "gs://"


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
    """A google-cloud-storage client; anonymous against an emulator (``STORAGE_EMULATOR_HOST``)."""
    return _client(os.environ.get("STORAGE_EMULATOR_HOST"), os.environ.get("GOOGLE_CLOUD_PROJECT"))


def _blob(uri: str):  # noqa: ANN202
    bucket, key = split_gs(uri)
    return gcs_client().bucket(bucket).blob(key)


# --- single objects -------------------------------------------------------------------------


def read_bytes(uri: str) -> bytes:
    if is_remote(uri):
        return _blob(uri).download_as_bytes()
    with open(uri, "rb") as f:
        return f.read()


def read_bytes_from(uri: str, offset: int) -> bytes:
    """The bytes of an object from ``offset`` on (b"" when it is no longer than that)."""
    if is_remote(uri):
        blob = _blob(uri)
        blob.reload()
        if (blob.size or 0) <= offset:
            return b""
        return blob.download_as_bytes(start=offset)
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


def write_bytes(uri: str, data: bytes) -> None:
    if is_remote(uri):
        _blob(uri).upload_from_string(data)
        return
    directory = os.path.dirname(uri) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, uri)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def exists(uri: str) -> bool:
    if is_remote(uri):
        return _blob(uri).exists()
    return os.path.exists(uri)


def delete(uri: str) -> None:
    if is_remote(uri):
        blob = _blob(uri)
        if blob.exists():
            blob.delete()
    elif os.path.isdir(uri):
        shutil.rmtree(uri, ignore_errors=True)
    elif os.path.exists(uri):
        os.unlink(uri)


def upload_file(local_path: str, uri: str) -> None:
    if is_remote(uri):
        _blob(uri).upload_from_filename(local_path)
        return
    with open(local_path, "rb") as f:
        write_bytes(uri, f.read())


def download_file(uri: str, local_path: str) -> None:
    os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
    if is_remote(uri):
        _blob(uri).download_to_filename(local_path)
    else:
        shutil.copyfile(uri, local_path)


# --- prefixes (folders) -----------------------------------------------------------------------


def list_files(prefix: str, suffix: str = "") -> list[str]:
    """Every file (object) below ``prefix``, recursively, as full URIs/paths, sorted."""
    return sorted(u for u in _walk(prefix) if u.endswith(suffix))


def _walk(prefix: str) -> Iterator[str]:
    if is_remote(prefix):
        bucket, key = split_gs(prefix)
        key = key.rstrip("/") + "/" if key else ""
        for blob in gcs_client().list_blobs(bucket, prefix=key):
            yield f"{GS_PREFIX}{bucket}/{blob.name}"
        return
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
        iterator = gcs_client().list_blobs(bucket, prefix=key, delimiter="/")
        list(iterator)  # the prefixes are filled in while pages are consumed
        return sorted(p[len(key) :].rstrip("/") for p in iterator.prefixes)
    if not os.path.isdir(prefix):
        return []
    return sorted(d for d in os.listdir(prefix) if os.path.isdir(os.path.join(prefix, d)))


def upload_dir(local_dir: str, uri: str) -> list[str]:
    """Copy every file of a local folder below ``uri``; returns the relative names copied."""
    names = []
    for dirpath, _dirs, files in os.walk(local_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, local_dir)
            upload_file(path, f"{uri.rstrip('/')}/{rel}")
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
