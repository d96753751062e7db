"""Clusters of separate hosts: the host spec, where each node runs, and the launcher's cluster file.

A ``hosts`` cluster is a list of hosts (``JobSpec.hosts``), each reached over SSH by the pipeline's
``hosts`` backend, which starts one fork server per host listening on the host's cluster-internal
address. The launcher of a segment runs on the **chief host** beside the segment's chief (the ASP
coordinator, or BSP worker 0), so the chief's progress and kill-request files are local to it; it forks
every other node through its host's fork server over TCP.

Placement (``place_nodes``) by the hosts' optional ``role`` (chief, worker, ps; default any):
    chief host      the first host with role chief, else the first host: the ASP chief, BSP worker 0
    ASP worker i    the i-th worker host, round robin (worker hosts: role worker, else role any,
                    else every host)
    BSP worker i    (i >= 1) where ASP worker i runs (BSP: every all-reduce protocol; ASP: every
                    parameter-server one, syncswitch.protocols)
    parameter server j   the j-th ps host, round robin (ps hosts: role ps, else any, else every host)

Nothing here holds a secret: a host names its SSH key by path (or a ``gs://`` object), or names an
Airflow SSH connection (``conn``: address, user, port, key and host-key policy, read on the Airflow
side), and the cluster's fork-server token lives in a file on each host (``token_file``), never in a
spec, log, XCom or state.json.
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

from syncswitch.errors import SpecError
from syncswitch.protocols import ALLREDUCE, family

ROLES = ("any", "chief", "worker", "ps")
# OpenSSH's host key types, the preferred first (where a host publishes several, it is pinned).
HOST_KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
)
FIELD = "hosts"
DEFAULT_WORK_ROOT = "/tmp/syncswitch-hosts"
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9-]{1,63})*$"
)
_USER_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
_CONN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")


@dataclass(frozen=True)
class HostSpec:
    """One host of a ``hosts`` cluster. ``python`` is the interpreter that has the training runtime on
    the host ("" = the same path as on the Airflow worker, as in this project's image)."""

    address: str
    # The SSH private key: a path on every Airflow worker, or a gs:// object that every worker reads
    # (on a distributed Airflow, where workers share no disk). It never goes to the hosts.
    key: str
    user: str = "root"
    port: int = 22
    role: str = "any"
    python: str = ""
    work_root: str = DEFAULT_WORK_ROOT
    name: str = ""  # shown in logs and messages; default: the address
    # An Airflow SSH connection (ssh_conn_id): the key and host-key policy, and the address, user and
    # port where this spec names none. Read by the Airflow side at each login, never stored here.
    conn: str = ""
    # The public host key the host must present ("ssh-ed25519 AAAA..."), pinned with the run (a gce
    # VM's, from its guest attributes): no known_hosts file needs to be on every Airflow worker. Or a
    # file holding it (an absolute path or gs:// object: a .pub line), read at each login.
    # Empty: [syncswitch] ssh_known_hosts, or (neither set) any key, with a warning.
    host_key: str = ""
    # The address is a DNS name that resolves to several hosts (a compose service's replicas, a
    # Kubernetes headless service): one host per address it resolves to at provisioning, in address
    # order, each with this spec's other keys.
    each_address: bool = False

    @property
    def label(self) -> str:
        return self.name or self.address

    @classmethod
    def parse(cls, item: Any, position: int) -> HostSpec:
        """``address=10.0.0.2,key=/k,role=worker`` (or ``conn=my_ssh,role=worker``) or the same keys as a
        dict; SpecError names the field."""
        where = f"host {position}"
        if isinstance(item, dict):
            pairs = {str(k): v for k, v in item.items()}
        elif isinstance(item, str):
            pairs = {}
            for part in item.split(","):
                key, sep, value = part.strip().partition("=")
                if not sep:
                    raise SpecError(
                        FIELD, f"{where}: malformed item {part!r}; expected address=10.0.0.2,key=/path"
                    )
                pairs[key.strip()] = value.strip()
        else:
            raise SpecError(FIELD, f"{where}: must be a dict or 'key=value,...' text, got {item!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(pairs) - known)
        if unknown:
            raise SpecError(
                FIELD, f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(sorted(known))}"
            )
        conn = str(pairs.get("conn") or "")
        for required in ("address", "key") if not conn else ():
            if not pairs.get(required):
                raise SpecError(
                    FIELD,
                    f"{where}: needs {required!r}, or 'conn' (an SSH connection id) "
                    f"(accepted keys: {', '.join(sorted(known))})",
                )
        # With a connection, what the spec leaves out comes from it (empty user, port 0 until then).
        try:
            port = int(pairs.get("port") or (0 if conn else 22))
        except (TypeError, ValueError):
            raise SpecError(FIELD, f"{where}: port must be an integer, got {pairs.get('port')!r}") from None
        host = cls(
            address=str(pairs.get("address") or ""),
            key=str(pairs.get("key") or ""),
            user=str(pairs.get("user") or ("" if conn else "root")),
            port=port,
            role=str(pairs.get("role") or "any"),
            python=str(pairs.get("python") or ""),
            work_root=str(pairs.get("work_root") or DEFAULT_WORK_ROOT),
            name=str(pairs.get("name") or ""),
            conn=conn,
            # TYPE BASE64, a comment after them dropped (a .pub file's line works as it is).
            host_key=" ".join(str(pairs.get("host_key") or "").split()[:2]),
            each_address=_flag(pairs.get("each_address"), where),
        )
        host.validate(where)
        return host

    def validate(self, where: str) -> None:
        if self.conn and not _CONN_ID_RE.match(self.conn):
            raise SpecError(
                FIELD, f"{where}: conn {self.conn!r} is not a connection id (letters, digits, _.-)"
            )
        if self.conn and self.key:
            raise SpecError(FIELD, f"{where}: give key or conn (whose connection holds the key), not both")
        if self.host_key:
            if self.conn:
                raise SpecError(
                    FIELD, f"{where}: give host_key or conn (whose connection pins the host key), not both"
                )
            if not self.host_key_file:
                check_host_key(self.host_key, where)
        if self.each_address and (self.conn or not _HOSTNAME_RE.match(self.address) or _is_ip(self.address)):
            raise SpecError(FIELD, f"{where}: each_address needs an address that is a DNS name, not conn")
        from_conn = bool(self.conn)  # what is empty here comes from the connection
        if (self.address or not from_conn) and not _is_address(self.address):
            raise SpecError(FIELD, f"{where}: address {self.address!r} is not an IP address or host name")
        if (self.port or not from_conn) and not 1 <= self.port <= 65535:
            raise SpecError(FIELD, f"{where}: port must be in 1..65535, got {self.port}")
        if (self.user or not from_conn) and not _USER_RE.match(self.user):
            raise SpecError(FIELD, f"{where}: user {self.user!r} is not a valid user name")
        if self.role not in ROLES:
            raise SpecError(FIELD, f"{where}: role {self.role!r} is not one of: {', '.join(ROLES)}")
        checked = ("work_root",) + (("python",) if self.python else ()) + (("key",) if self.key else ())
        checked += ("host_key",) if self.host_key_file else ()
        for name in checked:
            value = getattr(self, name)
            in_bucket = name in ("key", "host_key") and value.startswith("gs://")
            if not (value.startswith("/") or in_bucket) or any(c in value for c in "\n\0'\"$`\\ "):
                what = "an absolute path" + ("" if name in ("work_root", "python") else " or a gs:// object")
                raise SpecError(FIELD, f"{where}: {name} must be {what}, without quotes or spaces")

    @property
    def host_key_file(self) -> bool:
        """Whether ``host_key`` names a file (a path or gs:// object) rather than being the key."""
        return self.host_key.startswith(("/", "gs://"))

    def to_text(self) -> str:
        """The ``key=value,...`` form: address and key always (unless a connection gives them), the
        rest where not the default; what is left to the connection (empty, port 0) stays out."""
        defaults = HostSpec("", "")
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            required = f.name in ("address", "key") and not self.conn
            if required or (value not in ("", 0) and value != getattr(defaults, f.name)):
                parts.append(f"{f.name}={value}")
        return ",".join(parts)


def check_host_key(text: str, where: str) -> None:
    """``TYPE BASE64`` of one of OpenSSH's host key types (a known_hosts line without its host)."""
    key_type, _, blob = text.partition(" ")
    try:
        decoded = base64.b64decode(blob, validate=True)
    except ValueError:
        decoded = b""
    # The blob starts with its own type name (RFC 4253 6.6): a key pasted under the wrong type fails.
    if key_type not in HOST_KEY_TYPES or decoded[4 : 4 + len(key_type)] != key_type.encode():
        raise SpecError(
            FIELD,
            f"{where}: host_key must be 'TYPE BASE64' as in known_hosts (TYPE: {', '.join(HOST_KEY_TYPES)}), "
            f"got {text[:40]!r}",
        )


def _flag(value: Any, where: str) -> bool:  # noqa: ANN401 - text or JSON
    """A host spec's boolean key: true/false (any case), 1/0, or a JSON boolean."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise SpecError(FIELD, f"{where}: each_address must be true or false, got {value!r}")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME_RE.match(text))


def parse_hosts(value: Any) -> tuple[HostSpec, ...]:
    """The ``hosts`` param: a list of host specs (dicts or text), or a JSON list as text."""
    if value in (None, "", []):
        return ()
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            try:
                value = json.loads(stripped)
            except ValueError as exc:
                raise SpecError(FIELD, f"is not a valid JSON list: {exc}") from None
        else:
            value = [v for v in stripped.split(";") if v.strip()]
    if not isinstance(value, list | tuple):
        raise SpecError(FIELD, f"must be a list of hosts, got {value!r}")
    hosts = tuple(HostSpec.parse(item, i) for i, item in enumerate(value))
    seen: dict[tuple[str, int], int] = {}
    for i, host in enumerate(hosts):
        where = (host.address or f"conn={host.conn}", host.port)
        if where in seen:
            raise SpecError(FIELD, f"host {i}: {where[0]}:{where[1]} is also host {seen[where]}")
        seen[where] = i
    return hosts


# ---- placement ------------------------------------------------------------------------------------


def chief_host(roles: list[str]) -> int:
    """The index of the host that runs the launcher and the segment's chief."""
    return roles.index("chief") if "chief" in roles else 0


def _candidates(roles: list[str], role: str) -> list[int]:
    for wanted in (role, "any"):
        found = [i for i, r in enumerate(roles) if r == wanted]
        if found:
            return found
    return list(range(len(roles)))


def place_nodes(roles: list[str], protocol: str, num_workers: int, num_ps: int) -> list[tuple[str, int, int]]:
    """``(role, task, host index)`` of every node of a segment, chief first (the launcher's order)."""
    chief = chief_host(roles)
    workers = _candidates(roles, "worker")
    worker_host = [workers[i % len(workers)] for i in range(num_workers)]
    if family(protocol).topology == ALLREDUCE:
        return [("worker", i, chief if i == 0 else worker_host[i]) for i in range(num_workers)]
    ps = _candidates(roles, "ps")
    return (
        [("chief", 0, chief)]
        + [("worker", i, worker_host[i]) for i in range(num_workers)]
        + [("ps", j, ps[j % len(ps)]) for j in range(num_ps)]
    )


# ---- the launcher's cluster file -------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterHost:
    """One host as the launcher sees it: where its fork server listens and its work folder."""

    name: str
    address: str  # cluster-internal: TF_CONFIG and the fork server use it
    role: str
    forkserver: str  # "address:port"
    work_dir: str


@dataclass(frozen=True)
class ClusterFile:
    """``cluster.json`` beside a segment's spec on the chief host (``syncswitch train --cluster``)."""

    hosts: tuple[ClusterHost, ...]
    token_file: str  # on the chief host; every host's server holds the same token

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterFile:
        return cls(tuple(ClusterHost(**h) for h in data["hosts"]), str(data["token_file"]))

    def read_token(self) -> str:
        with open(self.token_file, encoding="utf-8") as f:
            return f.read().strip()
