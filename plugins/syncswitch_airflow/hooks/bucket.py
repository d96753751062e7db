"""The run bucket on the Airflow side: ``syncswitch.storage`` with a client made by the Google
provider's GCSHook from an Airflow connection (``[syncswitch] gcp_conn_id``), the way every Google
operator gets its credentials: a key in the connection or a secrets backend, not on the worker.

Training nodes import no Airflow and keep storage's plain client (their VM's or host's credentials).
Every Airflow entry point that touches the bucket (an operator's execute or resume, a trigger's run)
runs with a :class:`BucketHook`'s client: an operator method through :func:`with_bucket_credentials`,
a trigger's blocking calls through :meth:`BucketHook.in_thread`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from airflow.providers.google.cloud.hooks.gcs import GCSHook
from airflow.sdk.exceptions import AirflowNotFoundException
from syncswitch import storage

from syncswitch_airflow import metrics, settings

# Every Airflow process that reaches the bucket counts its retries (metrics.BUCKET_RETRIES).
metrics.count_bucket_retries()

CONN_SETTING = "gcp_conn_id"
DEFAULT_CONN_ID = "google_cloud_default"

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def default_conn_id() -> str:
    return settings.get(CONN_SETTING) or DEFAULT_CONN_ID


def bucket_client(conn_id: str | None = None) -> Any:
    """A google-cloud-storage client with the credentials of connection ``conn_id`` (the setting's
    by default). The default id may name no connection (the embedded default, a worker with its own
    service account): then storage's default client, with the environment's credentials. Any other id
    must exist: a deployment that names one means it."""
    conn_id = conn_id or default_conn_id()
    try:
        return GCSHook(gcp_conn_id=conn_id).get_conn()
    except AirflowNotFoundException:
        if conn_id != DEFAULT_CONN_ID:
            raise AirflowNotFoundException(
                f"[syncswitch] gcp_conn_id names the connection {conn_id!r}, which is not defined"
            ) from None
        log.debug("no connection %s: the bucket with the default credentials", conn_id)
        return storage.default_client()


class BucketHook:
    """The run bucket with connection ``gcp_conn_id``'s credentials (the setting's by default). The
    client is made once per hook, on the first call that needs it: a trigger polls the bucket every
    half second, and reading a connection is a call to the api-server."""

    def __init__(self, gcp_conn_id: str | None = None) -> None:
        self.gcp_conn_id = gcp_conn_id or default_conn_id()
        self._clients: list[Any] = []

    def get_conn(self) -> Any:
        if not self._clients:
            self._clients.append(bucket_client(self.gcp_conn_id))
        return self._clients[0]

    @contextlib.contextmanager
    def credentials(self) -> Iterator[None]:
        """Within the block, every bucket call of this context uses this hook's client."""
        with storage.client_from(self.get_conn):
            yield

    async def in_thread(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` in a thread (a trigger's event loop must not block), with this hook's
        client: a trigger's blocking calls (bucket reads, a backend's status over SSH, whose key may
        be a bucket object) go through here."""

        def with_credentials() -> T:
            with self.credentials():
                return call(*args)

        return await asyncio.to_thread(with_credentials)


def with_bucket_credentials(method: F) -> F:
    """An operator's execute (or resume) method, run inside :meth:`BucketHook.credentials`."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with BucketHook().credentials():
            return method(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
