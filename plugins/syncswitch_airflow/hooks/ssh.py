"""Hosts named by an Airflow SSH connection: ``conn=<ssh_conn_id>`` in a host spec.

The SSH provider's SSHHook reads the connection (from the metadata database or a secrets backend):
the host's address, user and port where the spec names none, and the key (``private_key`` or
``key_file`` in its extras) and host-key policy (``no_host_key_check``, ``host_key``,
``allow_host_key_change``) always. The key stays in the connection: it is read at every login on
whichever Airflow worker logs in, and never written to a disk, a spec or state.json. A host named
``address=...,key=...`` (the CLI's form) does not come here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import paramiko
from airflow.providers.ssh.hooks.ssh import SSHHook
from syncswitch.errors import SpecError
from syncswitch.hosts import FIELD, HostSpec


def connection_hook(
    conn_id: str, address: str = "", user: str = "", port: int = 0, timeout: float = 10.0
) -> SSHHook:
    """The provider's hook for ``conn_id``; the spec's own address, user and port win over the
    connection's. One connection attempt: the backend decides itself what a refused host means."""
    return SSHHook(
        ssh_conn_id=conn_id,
        remote_host=address,
        username=user or None,
        port=port or None,
        conn_timeout=int(timeout),
        auth_timeout=int(timeout),
        banner_timeout=timeout,
        conn_retry_attempts=1,
        keepalive_interval=0,
    )


def resolve_host(spec: HostSpec, position: int) -> HostSpec:
    """``spec`` with its connection's address, user and port where it names none (the address is the
    host's identity in the capacity ledger and the cluster's); a spec without ``conn`` as it is. A
    connection that does not exist or gives no address is a SpecError naming the host."""
    if not spec.conn:
        return spec
    where = f"host {position}"
    try:
        hook = connection_hook(spec.conn, spec.address, spec.user, spec.port)
    except Exception as exc:  # not defined, malformed extras: the reason, never a secret
        raise SpecError(FIELD, f"{where}: SSH connection {spec.conn!r}: {exc}") from None
    resolved = dataclasses.replace(
        spec, address=spec.address or hook.remote_host, user=hook.username, port=int(hook.port)
    )
    if not resolved.address:
        raise SpecError(FIELD, f"{where}: SSH connection {spec.conn!r} has no host, and the spec no address")
    resolved.validate(where)
    return resolved


def resolve_hosts(hosts: tuple[HostSpec, ...]) -> tuple[HostSpec, ...]:
    """Every host resolved (:func:`resolve_host`); two that resolve to one address are a SpecError."""
    resolved = tuple(resolve_host(h, i) for i, h in enumerate(hosts))
    seen: dict[tuple[str, int], int] = {}
    for i, host in enumerate(resolved):
        where = (host.address, host.port)
        if where in seen:
            raise SpecError(FIELD, f"host {i}: {host.address}:{host.port} is also host {seen[where]}")
        seen[where] = i
    return resolved


def connected_client(host: dict[str, Any], timeout: float) -> paramiko.SSHClient:
    """A logged-in SSH client for a host record with a ``conn`` (its key and host-key policy)."""
    hook = connection_hook(host["conn"], host["address"], host["user"], int(host["port"]), timeout)
    return hook.get_conn()
