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
import ipaddress
import socket
from pathlib import Path
from typing import Any

import paramiko
from airflow.providers.ssh.hooks.ssh import SSHHook
from syncswitch.errors import SpecError
from syncswitch.hosts import FIELD, HOST_KEY_TYPES, HostSpec, check_host_key


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


def each_address(spec: HostSpec, position: int) -> list[HostSpec]:
    """One host per address ``spec``'s DNS name resolves to now, in address order, where it asks so
    (``each_address``); else ``spec`` alone. A name that does not resolve is a SpecError."""
    if not spec.each_address:
        return [spec]
    try:
        found = socket.getaddrinfo(spec.address, spec.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise SpecError(FIELD, f"host {position}: {spec.address} does not resolve ({exc})") from None
    addresses = sorted({info[4][0] for info in found}, key=ipaddress.ip_address)
    name = spec.name or spec.address
    return [
        dataclasses.replace(spec, address=address, name=f"{name}@{address}", each_address=False)
        for address in addresses
    ]


def resolve_hosts(hosts: tuple[HostSpec, ...]) -> tuple[HostSpec, ...]:
    """Every host resolved (:func:`resolve_host`) and expanded (:func:`each_address`); two that resolve
    to one address are a SpecError."""
    resolved = tuple(
        expanded for i, h in enumerate(hosts) for expanded in each_address(resolve_host(h, i), i)
    )
    seen: dict[tuple[str, int], int] = {}
    for i, host in enumerate(resolved):
        where = (host.address, host.port)
        if where in seen:
            raise SpecError(FIELD, f"host {i}: {host.address}:{host.port} is also host {seen[where]}")
        seen[where] = i
    return resolved


def pinned_host_key(host_key: str, where: str) -> str:
    """A host spec's ``host_key`` as ``TYPE BASE64``: the key itself, or read from the file it names
    (a path on the Airflow worker or a gs:// object: a .pub or known_hosts-style line)."""
    if not host_key.startswith(("/", "gs://")):
        return host_key
    from syncswitch import storage

    try:
        text = storage.read_text(host_key) if storage.is_remote(host_key) else Path(host_key).read_text()
    except Exception as exc:  # missing, unreadable, the bucket away: named
        reason = type(exc).__name__
        raise SpecError(FIELD, f"{where}: host_key file {host_key} cannot be read: {reason}") from None
    fields = text.split()
    key = " ".join(fields[:2] if fields and fields[0] in HOST_KEY_TYPES else fields[1:3])
    check_host_key(key, where)
    return key


def connected_client(host: dict[str, Any], timeout: float) -> paramiko.SSHClient:
    """A logged-in SSH client for a host record with a ``conn`` (its key and host-key policy)."""
    hook = connection_hook(host["conn"], host["address"], host["user"], int(host["port"]), timeout)
    return hook.get_conn()
