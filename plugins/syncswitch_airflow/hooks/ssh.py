"""SSH to the cluster's hosts: one session per host (commands and small files), and an action run on
every host at once.

A host is a host record (``backends.hosts.host_record``): its address, port, user, and either a key
(a file on this worker, or an object in the bucket) or ``conn=<ssh_conn_id>``, an Airflow SSH
connection. With a connection, the SSH provider's SSHHook reads it (from the metadata database or a
secrets backend): the host's address, user and port where the spec names none, and the key
(``private_key`` or ``key_file`` in its extras) and host-key policy (``no_host_key_check``,
``host_key``, ``allow_host_key_change``) always. The key stays in the connection: it is read at every
login on whichever Airflow worker logs in, and never written to a disk, a spec or state.json.

Without a connection, the host key is checked against the host's pinned ``host_key``, else
``[syncswitch] ssh_known_hosts``; with neither, any is accepted. Every error is a ClusterError that
names the host. A gce run's own key is made here too (``ensure_private_key``), in its bucket folder.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import paramiko
from airflow.providers.ssh.hooks.ssh import SSHHook
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from syncswitch import storage
from syncswitch.errors import SpecError
from syncswitch.hosts import FIELD, HOST_KEY_TYPES, HostSpec, check_host_key

from syncswitch_airflow import settings
from syncswitch_airflow.backends.base import ClusterError

CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 120.0

T = TypeVar("T")
H = TypeVar("H")


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


class HostKeyRefused(ClusterError):
    """The host showed another SSH host key than the one expected: not the machine it should be."""


class SshSession:
    """One SSH connection to one host; commands and small files. Errors name the host."""

    def __init__(self, host: dict[str, Any], timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.host, self.timeout = host, timeout
        self.where = f"host {host['name']} ({host['user']}@{host['address']}:{host['port']})"
        self.client = paramiko.SSHClient()

    def __enter__(self) -> SshSession:
        if self.host.get("conn"):
            self._connect_with_connection()
            return self
        pinned = self._host_key_policy()
        key = self._key()
        try:
            self.client.connect(
                self.host["address"],
                port=int(self.host["port"]),
                username=self.host["user"],
                **key,
                look_for_keys=False,
                allow_agent=False,
                timeout=self.timeout,
                banner_timeout=self.timeout,
                auth_timeout=self.timeout,
            )
        except paramiko.AuthenticationException as exc:
            self.client.close()
            raise ClusterError(f"{self.where}: SSH login failed: {exc}") from None
        except paramiko.BadHostKeyException as exc:
            self.client.close()
            raise HostKeyRefused(f"{self.where}: its host key is not the one {pinned}: {exc}") from None
        except paramiko.SSHException as exc:
            self.client.close()
            raise ClusterError(f"{self.where}: SSH failed: {exc}") from None
        except TimeoutError:
            self.client.close()
            raise ClusterError(f"{self.where}: unreachable: no answer within {self.timeout:.0f}s") from None
        except OSError as exc:
            self.client.close()
            raise ClusterError(f"{self.where}: unreachable: {exc.strerror or exc}") from None
        return self

    def _connect_with_connection(self) -> None:
        """Log in as the host's Airflow SSH connection says (its key and host-key policy)."""
        conn = f"connection {self.host['conn']}"
        try:
            self.client = connected_client(self.host, self.timeout)
        except paramiko.AuthenticationException as exc:
            raise ClusterError(f"{self.where}: SSH login failed ({conn}): {exc}") from None
        except paramiko.BadHostKeyException as exc:
            raise ClusterError(f"{self.where}: host key refused ({conn}): {exc}") from None
        except (paramiko.SSHException, OSError) as exc:
            raise ClusterError(f"{self.where}: SSH failed ({conn}): {exc}") from None
        except Exception as exc:  # the connection is gone or malformed: its reason, never a secret
            raise ClusterError(f"{self.where}: SSH {conn}: {exc}") from None

    def _host_key_policy(self) -> str:
        """Refuse any host key but the host's pinned one, else those of ``[syncswitch] ssh_known_hosts``;
        with neither, accept any (paramiko warns). Returns where the expected key comes from."""
        if self.host.get("host_key"):
            try:
                key_type, _, blob = pinned_host_key(self.host["host_key"], self.where).partition(" ")
            except SpecError as exc:
                raise ClusterError(str(exc)) from None
            port = int(self.host["port"])
            name = self.host["address"] if port == 22 else f"[{self.host['address']}]:{port}"
            key = paramiko.PKey.from_type_string(key_type, base64.b64decode(blob))
            self.client.get_host_keys().add(name, key_type, key)
            self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            return "pinned with the run (host_key)"
        known_hosts = settings.get("ssh_known_hosts")
        if known_hosts:
            self.client.load_host_keys(known_hosts)
            self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            return f"in {known_hosts}"
        self.client.set_missing_host_key_policy(paramiko.WarningPolicy())
        return "accepted"

    def _key(self) -> dict[str, Any]:
        """paramiko's key argument: a key file on this worker, or a key in the bucket (a gce run's own,
        in its run folder, which every Airflow worker reads)."""
        key = self.host["key"]
        if not storage.is_remote(key):
            if not os.path.isfile(key):
                raise ClusterError(f"{self.where}: SSH key file {key} does not exist")
            return {"key_filename": key}
        try:
            return {"pkey": load_private_key(storage.read_text(key))}
        except Exception as exc:  # not found, not a key, the bucket down: named, never its content
            reason = type(exc).__name__
            raise ClusterError(f"{self.where}: SSH key {key} cannot be loaded: {reason}") from None

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S, stdin: str = "") -> tuple[int, str, str]:
        try:
            into, stdout, stderr = self.client.exec_command(command, timeout=timeout)
            if stdin:
                into.write(stdin)
                into.channel.shutdown_write()
            out, err = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
            return stdout.channel.recv_exit_status(), out, err
        except (paramiko.SSHException, OSError) as exc:
            raise ClusterError(f"{self.where}: command failed to run: {exc}") from None

    def check(self, command: str, what: str, timeout: float = COMMAND_TIMEOUT_S, stdin: str = "") -> str:
        code, out, err = self.run(command, timeout, stdin)
        if code != 0:
            raise ClusterError(f"{self.where}: {what} failed (exit {code}): {(err or out).strip()[-800:]}")
        return out

    def json(
        self, command: str, what: str, timeout: float = COMMAND_TIMEOUT_S, stdin: str = ""
    ) -> dict[str, Any]:
        out = self.check(command, what, timeout, stdin)
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ClusterError(f"{self.where}: {what} printed no JSON: {out[-300:]!r}") from None

    def write_file(self, path: str, content: str | bytes, mode: int = 0o644) -> None:
        try:
            with self.client.open_sftp() as sftp, sftp.open(path, "w") as f:
                f.write(content)
                sftp.chmod(path, mode)
        except (paramiko.SSHException, OSError) as exc:
            raise ClusterError(f"{self.where}: cannot write {path}: {exc}") from None


def load_private_key(text: str) -> paramiko.PKey:
    """A private key in OpenSSH or PEM form, of any type paramiko knows."""
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text))
        except paramiko.SSHException:
            continue
    raise ValueError("not an unencrypted Ed25519, ECDSA or RSA private key")


def ensure_private_key(uri: str) -> str:
    """The Ed25519 key at ``uri`` (a run's, in its bucket folder), made once (``storage.create_private``:
    the first worker's wins); returns its public half, as an ``authorized_keys`` line."""
    private = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    key = serialization.load_ssh_private_key(storage.create_private(uri, private), password=None)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return public.decode() + " syncswitch-run"


def host_key_fingerprint(host_key: str) -> str:
    """OpenSSH's fingerprint of a ``TYPE BASE64`` key (what ``ssh-keygen -lf`` and a VM's serial console
    print), for logs."""
    key_type, _, blob = host_key.partition(" ")
    digest = base64.b64encode(hashlib.sha256(base64.b64decode(blob)).digest()).decode().rstrip("=")
    return f"{key_type} SHA256:{digest}"


def on_hosts(hosts: Sequence[H], action: Callable[[H], T]) -> list[T | ClusterError]:
    """``action`` on every host at once; a host's ClusterError is its result, not raised."""

    def guarded(host: H) -> T | ClusterError:
        try:
            return action(host)
        except ClusterError as exc:
            return exc

    # Each thread with the caller's storage client (an Airflow task's: the bucket connection's).
    with ThreadPoolExecutor(max_workers=max(len(hosts), 1)) as pool:
        return [f.result() for f in storage.submit_each(pool, guarded, hosts)]


def all_or_raise(results: list[T | ClusterError]) -> list[T]:
    """``on_hosts``'s results, unless a host failed: then one ClusterError naming each that did."""
    failures = [str(r) for r in results if isinstance(r, ClusterError)]
    if failures:
        raise ClusterError("; ".join(failures))
    return [r for r in results if not isinstance(r, ClusterError)]
