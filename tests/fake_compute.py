"""A fake Compute Engine API (REST, v1) whose instances are hosts of the network-namespace testbed.

There is no Compute Engine emulator, so the tests of a Compute Engine cluster backend talk to this one:
an HTTP server on 127.0.0.1 that speaks the real REST paths and JSON (camelCase, as
``google.cloud.compute_v1`` and ``googleapiclient``'s discovery document expect). An instance
inserted here is a real host (``Testbed.add_host``): its internal IP answers SSH with the keys of its
``ssh-keys`` metadata, processes started there run in its own network namespace, and deleting or
preempting it kills them all.

    bed = Testbed("fce", 0); bed.up()
    with FakeComputeEngine(bed, "my-project") as fake:
        client = compute_v1.InstancesClient(
            credentials=AnonymousCredentials(), client_options=ClientOptions(api_endpoint=fake.endpoint))
        ...
        fake.preempt("worker-1")     # the host is gone; a compute.instances.preempted operation
        fake.stock_out("us-central1-a", count=2)   # the next two inserts there fail
        fake.publish_host_key_instead(key)   # guest attributes name another SSH host key
    bed.down()                       # removes the hosts of instances still alive

What it covers: instances (insert, get, delete, list, aggregatedList, the ``hostkeys/`` guest
attributes), zone and global operations (get, wait, list), firewalls (insert, get, delete, list).
Operations finish before the request that made them is answered: with ``pending_operations=True``
the answer still shows them RUNNING (as GCE does) and the next get or wait DONE. Beware that
``InstancesClient``'s ``ExtendedOperation.result()`` polls through a ``ZoneOperationsClient`` of its
own, made without the client's ``client_options``: it would ask compute.googleapis.com about a RUNNING
operation. Poll with a ``ZoneOperationsClient`` given the fake's endpoint (or Airflow's
``ComputeEngineHook``, whose discovery client takes ``client_options``).

Stricter than GCE where that catches a backend's mistakes: no ``accessConfigs`` (internal IPs only),
one network interface, firewalls need ``sourceTags`` or ``sourceRanges`` and ``targetTags``. Firewalls
are recorded, not enforced: the testbed's hosts reach each other whatever the rules say. As GCE, it
refuses an accelerator type that is no longer offered (``RETIRED_ACCELERATOR_TYPES``); any other type
is taken in any zone.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import testbed as tb

API_ROOT = "https://www.googleapis.com/compute/v1"
_API_PREFIXES = ("https://www.googleapis.com/compute/v1/", "https://compute.googleapis.com/compute/v1/")
_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1035, as every GCE resource name
_ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")
_LABEL_KEY = re.compile(r"[a-z][-_a-z0-9]{0,62}")
_LABEL_VALUE = re.compile(r"[-_a-z0-9]{0,63}")
_PROTOCOLS = {"tcp", "udp", "icmp", "esp", "ah", "sctp", "ipip", "all"}
_PORT_RANGE = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")

# Accelerator types Compute Engine offers in no zone any more: an instance asking for one is refused.
RETIRED_ACCELERATOR_TYPES = frozenset({"nvidia-tesla-k80"})
PREEMPTED = "compute.instances.preempted"
STOCKOUT_CODE = "ZONE_RESOURCE_POOL_EXHAUSTED"


class ApiError(Exception):
    """An error answer in Google's JSON format: {"error": {"code", "message", "errors": [...]}}."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.status,
                "message": self.message,
                "errors": [{"message": self.message, "domain": "global", "reason": self.reason}],
            }
        }


def _invalid(message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, "invalid", message)


def _not_found(what: str) -> ApiError:
    return ApiError(HTTPStatus.NOT_FOUND, "notFound", f"The resource '{what}' was not found")


def _timestamp() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------------------------------------------
# list filters


_COMPARISON = re.compile(
    r"""(?P<field>[A-Za-z][\w.-]*)\s*(?P<op>!=|=|:|\beq\b|\bne\b)\s*"""
    r"""(?P<value>"(?:[^"\\]|\\.)*"|'[^']*'|[^\s()]+)"""
)


@dataclass(frozen=True)
class _Comparison:
    path: tuple[str, ...]
    op: str
    value: str

    def matches(self, resource: dict[str, Any]) -> bool:
        found: Any = resource
        for key in self.path:
            found = found.get(key) if isinstance(found, dict) else None
        if found is None:
            return self.op in ("!=", "ne")
        if isinstance(found, bool):
            text = "true" if found else "false"
        elif isinstance(found, (dict, list)):
            text = json.dumps(found)
        else:
            text = str(found)
        if self.op == ":" and self.value == "*":
            return True
        if self.op in ("=", ":"):
            return text == self.value
        if self.op == "!=":
            return text != self.value
        matched = re.fullmatch(self.value, text) is not None  # eq, ne: a regular expression (RE2)
        return matched if self.op == "eq" else not matched


def compile_filter(expression: str | None) -> Callable[[dict[str, Any]], bool]:
    """A list filter as GCE reads it, the conjunctive part: comparisons joined by AND or by spaces,
    each maybe in parentheses. ``field = "v"``, ``field != v``, ``field:*`` (present), ``field eq re``,
    ``field ne re``; fields are dotted paths (``labels.job``, ``name``, ``operationType``)."""
    if not expression or not expression.strip():
        return lambda resource: True
    comparisons = []
    for match in _COMPARISON.finditer(expression):
        value = match["value"]
        if value[:1] in "\"'" and value[-1:] == value[:1] and len(value) >= 2:
            value = re.sub(r"\\(.)", r"\1", value[1:-1]) if value[0] == '"' else value[1:-1]
        comparisons.append(_Comparison(tuple(match["field"].split(".")), match["op"], value))
    rest = _COMPARISON.sub(" ", expression).replace("(", " ").replace(")", " ").split()
    if not comparisons or any(word != "AND" for word in rest):
        raise _invalid(
            f"Invalid list filter expression {expression!r} (this fake knows comparisons "
            "joined by AND or spaces, not OR or NOT)"
        )
    return lambda resource: all(c.matches(resource) for c in comparisons)


# ---------------------------------------------------------------------------------------------------
# the state


@dataclass
class _Record:
    """One instance in the ledger: what it was and how long it ran."""

    name: str
    zone: str
    machine_type: str
    gpu_type: str
    gpu_count: int
    spot: bool
    created_at: float
    running_at: float | None = None
    ended_at: float | None = None

    def as_dict(self, now: float) -> dict[str, Any]:
        active = 0.0
        if self.running_at is not None:
            active = max(0.0, (self.ended_at if self.ended_at is not None else now) - self.running_at)
        return {
            "name": self.name,
            "zone": self.zone,
            "machine_type": self.machine_type,
            "gpu_type": self.gpu_type,
            "gpu_count": self.gpu_count,
            "spot": self.spot,
            "created_at": self.created_at,
            "ended_at": self.ended_at,
            "active_seconds": active,
        }


@dataclass
class _Instance:
    zone: str
    resource: dict[str, Any]  # the Instance JSON that GET answers
    record: _Record
    host: tb.TestHost | None = None
    busy: bool = False  # being created or deleted: a DELETE now is refused (resourceNotReady)

    @property
    def name(self) -> str:
        return self.resource["name"]

    @property
    def status(self) -> str:
        return self.resource["status"]


@dataclass
class _InsertPlan:
    """What an insert asks for, validated: the ledger's view and the host's SSH setup."""

    resource: dict[str, Any]
    machine_type: str
    gpu_type: str
    gpu_count: int
    spot: bool
    authorized_keys: str | None
    users: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# the server


class FakeComputeEngine:
    """A fake Compute Engine REST API for one project; instances are hosts of `bed` (which must be up).

    ssh_user_map: maps the users of ``ssh-keys`` metadata (``user:ssh-ed25519 AAAA... comment``) to the
    login names the host's sshd allows (the hosts share this machine's users, so they must exist here):
    ``{"syncswitch": "root"}``; a user not in the map keeps its name. None: any login name is allowed
    with the keys. An instance without ``ssh-keys`` accepts the testbed's key, as project-wide keys
    would (unless its metadata sets ``block-project-ssh-keys`` to true).
    pending_operations: see the module docstring.
    """

    def __init__(
        self,
        bed: tb.Testbed,
        project: str,
        ssh_user_map: dict[str, str] | None = None,
        *,
        pending_operations: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        self.bed = bed
        self.listen_address = host  # a testbed's gateway for Airflow workers on testbed hosts
        self.project = project
        self.ssh_user_map = ssh_user_map
        self.pending_operations = pending_operations
        self.requests: list[tuple[str, str]] = []  # (method, path without the query) of every request
        self._lock = threading.Lock()
        self._instances: dict[tuple[str, str], _Instance] = {}  # (zone, name)
        self._records: list[_Record] = []
        self._operations: dict[str, tuple[str | None, dict[str, Any]]] = {}  # name -> (zone, JSON)
        self._firewalls: dict[str, dict[str, Any]] = {}
        self._stock_outs: dict[str, int] = {}
        self._published_host_key: str | None = None  # publish_host_key_instead
        self._ids = itertools.count(int(time.time() * 1000) * 1000)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        zone, name = r"zones/(?P<zone>[^/]+)", r"(?P<name>[^/]+)"
        routes: list[tuple[str, str, Callable[..., dict[str, Any]]]] = [
            ("POST", f"{zone}/instances", self._insert_instance),
            ("GET", f"{zone}/instances", self._list_instances),
            ("GET", f"{zone}/instances/{name}", self._get_instance),
            ("DELETE", f"{zone}/instances/{name}", self._delete_instance),
            ("GET", f"{zone}/instances/{name}/getGuestAttributes", self._get_guest_attributes),
            ("GET", "aggregated/instances", self._aggregated_instances),
            ("GET", f"{zone}/operations", self._list_zone_operations),
            ("GET", f"{zone}/operations/{name}", self._get_zone_operation),
            ("POST", f"{zone}/operations/{name}/wait", self._get_zone_operation),  # done already: no wait
            ("GET", "global/operations", self._list_global_operations),
            ("GET", f"global/operations/{name}", self._get_global_operation),
            ("POST", f"global/operations/{name}/wait", self._get_global_operation),
            ("POST", "global/firewalls", self._insert_firewall),
            ("GET", "global/firewalls", self._list_firewalls),
            ("GET", f"global/firewalls/{name}", self._get_firewall),
            ("DELETE", f"global/firewalls/{name}", self._delete_firewall),
        ]
        # Paths relative to /compute/v1/projects/{project}/.
        self._routes = [(method, re.compile(pattern), handler) for method, pattern, handler in routes]

    # ----- life cycle

    def start(self) -> str:
        """Serve on ``listen_address`` at a free port; returns the endpoint for client_options."""
        if self._server is None:
            self._server = ThreadingHTTPServer((self.listen_address, 0), _Handler)
            self._server.daemon_threads = True
            self._server.fake = self  # type: ignore[attr-defined]
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="fake-compute", daemon=True
            )
            self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        """Stop serving. The instances stay (their hosts too): the testbed's down() removes them."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = self._thread = None

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake Compute Engine is not started")
        return f"http://{self.listen_address}:{self._server.server_address[1]}"

    def __enter__(self) -> FakeComputeEngine:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    # ----- test controls

    def preempt(self, name: str, zone: str | None = None) -> dict[str, Any]:
        """Preempt a running Spot (or preemptible) instance: its host is removed; the instance is
        TERMINATED when its scheduling.instanceTerminationAction is STOP (GCE's default for Spot VMs),
        else deleted. Records a compute.instances.preempted operation, RUNNING while the VM stops and DONE
        once it has, which it returns."""
        with self._lock:
            instance = self._find(name, zone)
            if instance.status != "RUNNING" or instance.busy:
                raise ValueError(f"instance {name} is {instance.status}, not RUNNING: it cannot be preempted")
            if not instance.record.spot:
                raise ValueError(f"instance {name} is not a Spot or preemptible VM: GCE would not preempt it")
            instance.busy = True
            instance.resource["status"] = "STOPPING"
            # As Compute Engine does: the notice exists (RUNNING) from the start of the preemption and
            # is DONE once the VM has stopped, which is when its billing ends.
            operation = self._new_operation(
                PREEMPTED,
                instance.zone,
                instance.resource["selfLink"],
                target_id=instance.resource["id"],
                user="system",
            )
            operation["statusMessage"] = "Instance was preempted."
        if instance.host is not None:
            self.bed.remove_host(instance.host)
        with self._lock:
            instance.host = None
            instance.busy = False
            instance.record.ended_at = time.time()
            if instance.resource["scheduling"].get("instanceTerminationAction") == "STOP":
                instance.resource["status"] = "TERMINATED"
            else:
                del self._instances[(instance.zone, name)]
            self._finish(operation)
            return copy.deepcopy(operation)

    def stock_out(self, zone: str, count: int = 1) -> None:
        """The next `count` inserts in `zone` fail: their operation ends DONE with a
        ZONE_RESOURCE_POOL_EXHAUSTED error (HTTP 503), and no instance is created."""
        with self._lock:
            self._stock_outs[zone] = self._stock_outs.get(zone, 0) + count

    def publish_host_key_instead(self, host_key: str | None) -> None:
        """Every instance publishes ``host_key`` (``TYPE BASE64``) in its guest attributes instead of
        its host's own, as if its address answered for another machine; None: their own again."""
        with self._lock:
            self._published_host_key = host_key

    def instances(self) -> dict[str, dict[str, Any]]:
        """name -> Instance JSON of every instance that exists (RUNNING, TERMINATED, ...), in any zone."""
        with self._lock:
            return {i.name: copy.deepcopy(i.resource) for i in self._instances.values()}

    def host(self, name: str, zone: str | None = None) -> tb.TestHost | None:
        """The testbed host of an instance (None while it has none: provisioning or terminated)."""
        with self._lock:
            return self._find(name, zone).host

    def records(self) -> list[dict[str, Any]]:
        """The ledger, one record per instance ever created (stocked-out inserts create none): name,
        zone, machine_type and gpu_type (short names; "" without GPU), gpu_count, spot, created_at and
        ended_at (epoch seconds; ended_at None while alive), active_seconds (from RUNNING to deleted or
        preempted, or to now)."""
        now = time.time()
        with self._lock:
            return [record.as_dict(now) for record in self._records]

    def firewalls(self) -> dict[str, dict[str, Any]]:
        """name -> Firewall JSON of every firewall rule."""
        with self._lock:
            return copy.deepcopy(self._firewalls)

    def operations(self) -> list[dict[str, Any]]:
        """Every operation (zonal and global), oldest first."""
        with self._lock:
            return [copy.deepcopy(operation) for _, operation in self._operations.values()]

    # ----- requests

    def handle(self, method: str, url: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one request: (HTTP status, JSON body)."""
        parts = urlsplit(url)
        path = unquote(parts.path)
        self.requests.append((method, path))
        try:
            match = re.fullmatch(r"/compute/v1/projects/(?P<project>[^/]+)/(?P<rest>.+?)/?", path)
            if match is None:
                raise ApiError(HTTPStatus.NOT_FOUND, "notFound", f"No such API path: {path}")
            if match["project"] != self.project:
                raise _not_found(f"projects/{match['project']}")
            query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
            for route_method, pattern, handler in self._routes:
                route = pattern.fullmatch(match["rest"])
                if route is not None and route_method == method:
                    return HTTPStatus.OK, handler(**route.groupdict(), query=query, body=body)
            raise ApiError(HTTPStatus.NOT_FOUND, "notFound", f"No such API method: {method} {path}")
        except ApiError as exc:
            return exc.status, exc.body()

    def _zone_url(self, zone: str) -> str:
        return f"{API_ROOT}/projects/{self.project}/zones/{zone}"

    def _check_zone(self, zone: str) -> None:
        if not _ZONE.fullmatch(zone):
            raise _invalid(f"Invalid value for field 'zone': '{zone}'. Unknown zone.")

    def _find(self, name: str, zone: str | None) -> _Instance:
        found = [i for (z, n), i in self._instances.items() if n == name and zone in (None, z)]
        if not found:
            raise KeyError(f"no instance {name}" + (f" in {zone}" if zone else ""))
        if len(found) > 1:
            raise KeyError(f"instance {name} is in several zones: name one")
        return found[0]

    # ----- operations

    def _new_operation(
        self,
        operation_type: str,
        zone: str | None,
        target_link: str,
        *,
        target_id: str | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """A RUNNING operation, recorded (callers hold the lock)."""
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:13]}-{uuid.uuid4().hex[:8]}"
        scope = f"zones/{zone}" if zone else "global"
        operation: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(next(self._ids)),
            "name": name,
            "operationType": operation_type,
            "targetLink": target_link,
            "targetId": target_id or str(next(self._ids)),
            "status": "RUNNING",
            "user": user or f"fake-compute@{self.project}.iam.gserviceaccount.com",
            "progress": 0,
            "insertTime": _timestamp(),
            "startTime": _timestamp(),
            "selfLink": f"{API_ROOT}/projects/{self.project}/{scope}/operations/{name}",
        }
        if zone:
            operation["zone"] = self._zone_url(zone)
        self._operations[name] = (zone, operation)
        return operation

    @staticmethod
    def _finish(operation: dict[str, Any], error: ApiError | None = None, error_code: str = "") -> None:
        operation.update(status="DONE", progress=100, endTime=_timestamp())
        if error is not None:
            operation["error"] = {
                "errors": [{"code": error_code or error.reason.upper(), "message": error.message}]
            }
            operation["httpErrorStatusCode"] = error.status
            operation["httpErrorMessage"] = HTTPStatus(error.status).phrase.upper()

    def _answer(self, operation: dict[str, Any]) -> dict[str, Any]:
        """The operation as the request that started it answers: RUNNING with pending_operations."""
        answer = copy.deepcopy(operation)
        if self.pending_operations:
            for key in ("endTime", "error", "httpErrorStatusCode", "httpErrorMessage"):
                answer.pop(key, None)
            answer.update(status="RUNNING", progress=0)
        return answer

    def _get_operation(self, name: str, zone: str | None) -> dict[str, Any]:
        with self._lock:
            found = self._operations.get(name)
            if found is None or found[0] != zone:
                scope = f"zones/{zone}" if zone else "global"
                raise _not_found(f"projects/{self.project}/{scope}/operations/{name}")
            return copy.deepcopy(found[1])

    def _list_operations(self, zone: str | None, query: dict[str, str]) -> dict[str, Any]:
        matches = compile_filter(query.get("filter"))
        with self._lock:
            items = [copy.deepcopy(op) for z, op in self._operations.values() if z == zone and matches(op)]
        scope = f"zones/{zone}" if zone else "global"
        return _list_answer("compute#operationList", f"projects/{self.project}/{scope}/operations", items)

    def _get_zone_operation(self, zone: str, name: str, **_: Any) -> dict[str, Any]:
        return self._get_operation(name, zone)

    def _get_global_operation(self, name: str, **_: Any) -> dict[str, Any]:
        return self._get_operation(name, None)

    def _list_zone_operations(self, zone: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        return self._list_operations(zone, query)

    def _list_global_operations(self, query: dict[str, str], **_: Any) -> dict[str, Any]:
        return self._list_operations(None, query)

    # ----- instances

    def _insert_instance(self, zone: str, body: bytes, **_: Any) -> dict[str, Any]:
        self._check_zone(zone)
        plan = self._plan_insert(zone, _json_body(body))
        name = plan.resource["name"]
        with self._lock:
            if (zone, name) in self._instances:
                raise ApiError(
                    HTTPStatus.CONFLICT,
                    "alreadyExists",
                    f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' already exists",
                )
            operation = self._new_operation(
                "insert", zone, plan.resource["selfLink"], target_id=plan.resource["id"]
            )
            if self._stock_outs.get(zone, 0) > 0:
                self._stock_outs[zone] -= 1
                message = (
                    f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources "
                    "available to fulfill the request.  Try a different zone, or try again later."
                )
                self._finish(
                    operation, ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "unavailable", message), STOCKOUT_CODE
                )
                return self._answer(operation)
            record = _Record(
                name=name,
                zone=zone,
                machine_type=plan.machine_type,
                gpu_type=plan.gpu_type,
                gpu_count=plan.gpu_count,
                spot=plan.spot,
                created_at=time.time(),
            )
            instance = _Instance(zone=zone, resource=plan.resource, record=record, busy=True)
            self._instances[(zone, name)] = instance
            self._records.append(record)
        try:
            host = self.bed.add_host(plan.authorized_keys, users=plan.users)
        except Exception as exc:
            with self._lock:
                del self._instances[(zone, name)]
                self._records.remove(record)
                self._finish(
                    operation,
                    ApiError(
                        HTTPStatus.INTERNAL_SERVER_ERROR,
                        "internalError",
                        f"the testbed could not add a host: {exc}",
                    ),
                )
                return self._answer(operation)
        with self._lock:
            instance.host = host
            instance.busy = False
            instance.resource["networkInterfaces"][0]["networkIP"] = host.address
            instance.resource["status"] = "RUNNING"
            record.running_at = time.time()
            started = datetime.fromtimestamp(record.running_at, UTC)
            instance.resource["lastStartTimestamp"] = started.isoformat(timespec="milliseconds")
            self._finish(operation)
            return self._answer(operation)

    def _plan_insert(self, zone: str, body: dict[str, Any]) -> _InsertPlan:
        """Validate an Instance and make its stored JSON (still PROVISIONING, without networkIP)."""
        name = body.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid(
                f"Invalid value for field 'resource.name': {name!r}. Must be a match of regex "
                "'(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'"
            )
        machine_type = self._zonal_type(body.get("machineType"), zone, "machineTypes", "resource.machineType")
        disks = body.get("disks")
        if not isinstance(disks, list) or not disks:
            raise _invalid("Invalid value for field 'resource.disks': ''. At least one disk is required.")
        for i, disk in enumerate(disks):
            if not isinstance(disk, dict) or not (disk.get("initializeParams") or disk.get("source")):
                raise _invalid(
                    f"Invalid value for field 'resource.disks[{i}]': a disk needs initializeParams or source."
                )
        interfaces = body.get("networkInterfaces")
        if not isinstance(interfaces, list) or len(interfaces) != 1 or not isinstance(interfaces[0], dict):
            raise _invalid(
                "Invalid value for field 'resource.networkInterfaces': this fake takes exactly one "
                "network interface."
            )
        interface = dict(interfaces[0])
        if interface.get("accessConfigs") or interface.get("ipv6AccessConfigs"):
            raise _invalid(
                "Invalid value for field 'resource.networkInterfaces[0].accessConfigs': instances "
                "get internal IPs only here (no external IP, no access config)."
            )
        if interface.get("networkIP"):
            raise _invalid(
                "Invalid value for field 'resource.networkInterfaces[0].networkIP': this fake assigns "
                "internal IPs (the testbed host's address); do not ask for one."
            )
        interface.setdefault("network", f"{API_ROOT}/projects/{self.project}/global/networks/default")
        interface.update(kind="compute#networkInterface", name="nic0", stackType="IPV4_ONLY")
        labels = body.get("labels") or {}
        _check_labels(labels, "resource.labels")
        for tag in (body.get("tags") or {}).get("items") or []:
            if not isinstance(tag, str) or not _NAME.fullmatch(tag):
                raise _invalid(f"Invalid value for field 'resource.tags.items': {tag!r}")

        accelerators = body.get("guestAccelerators") or []
        gpu_types = set()
        gpu_count = 0
        for i, accelerator in enumerate(accelerators):
            where = f"resource.guestAccelerators[{i}]"
            url = accelerator.get("acceleratorType")
            gpu_type = self._zonal_type(url, zone, "acceleratorTypes", f"{where}.acceleratorType")
            if gpu_type in RETIRED_ACCELERATOR_TYPES:
                raise _invalid(
                    f"Invalid value for field '{where}.acceleratorType': {url!r}. Accelerator type "
                    f"{gpu_type!r} does not exist in zone {zone!r}."
                )
            gpu_types.add(gpu_type)
            count = accelerator.get("acceleratorCount")
            if not isinstance(count, int) or count < 1:
                raise _invalid(f"Invalid value for field '{where}.acceleratorCount': {count!r}")
            gpu_count += count
        if len(gpu_types) > 1:
            raise _invalid("Invalid value for field 'resource.guestAccelerators': one accelerator type only.")

        scheduling = dict(body.get("scheduling") or {})
        spot = scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True
        on_maintenance = scheduling.get("onHostMaintenance") or ("TERMINATE" if spot else "MIGRATE")
        if on_maintenance == "MIGRATE" and (spot or accelerators):
            why = "Spot and preemptible instances" if spot else "Instances with guest accelerators"
            raise _invalid(
                f"Invalid value for field 'resource.scheduling.onHostMaintenance': 'MIGRATE'. {why} "
                "do not support live migration."
            )
        action = scheduling.get("instanceTerminationAction")
        if action not in (None, "STOP", "DELETE"):
            raise _invalid(
                f"Invalid value for field 'resource.scheduling.instanceTerminationAction': {action!r}"
            )
        scheduling.update(
            onHostMaintenance=on_maintenance,
            preemptible=spot,
            provisioningModel="SPOT" if spot else scheduling.get("provisioningModel", "STANDARD"),
        )
        scheduling.setdefault("automaticRestart", not spot)
        if spot:
            scheduling.setdefault("instanceTerminationAction", "STOP")

        metadata = dict(body.get("metadata") or {})
        items = metadata.get("items") or []
        values = {item.get("key"): item.get("value", "") for item in items if isinstance(item, dict)}
        metadata.update(kind="compute#metadata", fingerprint=uuid.uuid4().hex[:12], items=items)
        authorized_keys, users = self._ssh_access(values)

        instance_id = str(next(self._ids))
        resource = {
            **copy.deepcopy(body),
            "kind": "compute#instance",
            "id": instance_id,
            "creationTimestamp": _timestamp(),
            "name": name,
            "zone": self._zone_url(zone),
            "machineType": f"{self._zone_url(zone)}/machineTypes/{machine_type}",
            "status": "PROVISIONING",
            "networkInterfaces": [interface],
            "labels": dict(labels),
            "scheduling": scheduling,
            "metadata": metadata,
            "selfLink": f"{self._zone_url(zone)}/instances/{name}",
        }
        return _InsertPlan(
            resource=resource,
            machine_type=machine_type,
            gpu_type=next(iter(gpu_types), ""),
            gpu_count=gpu_count,
            spot=spot,
            authorized_keys=authorized_keys,
            users=users,
        )

    def _zonal_type(self, url: Any, zone: str, collection: str, field_name: str) -> str:
        """The short name in a full or partial URL ``[projects/P/]zones/Z/<collection>/NAME``."""
        text = url if isinstance(url, str) else ""
        for prefix in _API_PREFIXES:
            text = text.removeprefix(prefix)
        match = re.fullmatch(
            rf"(?:projects/(?P<project>[^/]+)/)?zones/(?P<zone>[^/]+)/{collection}/"
            r"(?P<name>[a-z0-9][-a-z0-9]*)",
            text,
        )
        if match is None:
            raise _invalid(
                f"Invalid value for field '{field_name}': {url!r}. Must be a URL "
                f"'[projects/PROJECT/]zones/ZONE/{collection}/NAME', full or partial."
            )
        if match["project"] not in (None, self.project) or match["zone"] != zone:
            raise _invalid(
                f"Invalid value for field '{field_name}': {url!r}. It must be in the instance's "
                f"project and zone (projects/{self.project}/zones/{zone})."
            )
        return match["name"]

    def _ssh_access(self, metadata: dict[str, str]) -> tuple[str | None, list[str]]:
        """The host's authorized_keys text (None: the testbed's key) and allowed users from metadata."""
        lines = [line.strip() for line in metadata.get("ssh-keys", "").splitlines() if line.strip()]
        if not lines:
            blocked = metadata.get("block-project-ssh-keys", "").lower() == "true"
            return ("" if blocked else None), []
        keys, users = [], []
        for line in lines:
            user, sep, key = line.partition(":")
            if not sep or " " in user or not key.strip().startswith(("ssh-", "ecdsa-", "sk-")):
                raise _invalid(
                    f"Invalid value for field 'resource.metadata': ssh-keys line {line!r} is not "
                    "'USER:KEY_TYPE KEY [COMMENT]'"
                )
            keys.append(key.strip())
            login = self.ssh_user_map.get(user, user) if self.ssh_user_map is not None else None
            if login and login not in users:
                users.append(login)
        return "\n".join(keys) + "\n", users

    def _get_instance(self, zone: str, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            instance = self._instances.get((zone, name))
            if instance is None:
                raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
            return copy.deepcopy(instance.resource)

    def _get_guest_attributes(self, zone: str, name: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        """The ``hostkeys/`` namespace, which Google's guest environment fills on first boot where the
        metadata enables guest attributes: the host's sshd key. Anything else is not found, as on GCE
        before the guest writes it."""
        path = query.get("queryPath", "")
        resource = f"projects/{self.project}/zones/{zone}/instances/{name}/guestAttributes/{path}"
        with self._lock:
            instance = self._instances.get((zone, name))
            if instance is None:
                raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
            items = instance.resource["metadata"].get("items") or []
            enabled = any(
                i.get("key") == "enable-guest-attributes" and str(i.get("value")).lower() == "true"
                for i in items
            )
            host, published = instance.host, self._published_host_key
        if path != "hostkeys/" or not enabled or host is None or instance.status != "RUNNING":
            raise _not_found(resource)
        key_type, _, key = (published or self.bed.host_key(host)).partition(" ")
        return {
            "kind": "compute#guestAttributes",
            "queryPath": path,
            "queryValue": {"items": [{"namespace": "hostkeys", "key": key_type, "value": key}]},
            "selfLink": f"{self._zone_url(zone)}/instances/{name}/guestAttributes/{path}",
        }

    def _delete_instance(self, zone: str, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            instance = self._instances.get((zone, name))
            if instance is None:
                raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
            if instance.busy:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    "resourceNotReady",
                    f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' is not ready",
                )
            instance.busy = True
            if instance.status == "RUNNING":
                instance.resource["status"] = "STOPPING"
            operation = self._new_operation(
                "delete", zone, instance.resource["selfLink"], target_id=instance.resource["id"]
            )
        if instance.host is not None:
            self.bed.remove_host(instance.host)
        with self._lock:
            del self._instances[(zone, name)]
            if instance.record.ended_at is None:
                instance.record.ended_at = time.time()
            self._finish(operation)
            return self._answer(operation)

    def _list_instances(self, zone: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._check_zone(zone)
        matches = compile_filter(query.get("filter"))
        with self._lock:
            items = [
                copy.deepcopy(i.resource)
                for (z, _), i in self._instances.items()
                if z == zone and matches(i.resource)
            ]
        return _list_answer("compute#instanceList", f"projects/{self.project}/zones/{zone}/instances", items)

    def _aggregated_instances(self, query: dict[str, str], **_: Any) -> dict[str, Any]:
        matches = compile_filter(query.get("filter"))
        scoped: dict[str, dict[str, Any]] = {}
        with self._lock:
            for (zone, _), instance in self._instances.items():
                if matches(instance.resource):
                    scope = scoped.setdefault(f"zones/{zone}", {"instances": []})
                    scope["instances"].append(copy.deepcopy(instance.resource))
        answer = {
            "kind": "compute#instanceAggregatedList",
            "id": f"projects/{self.project}/aggregated/instances",
            "selfLink": f"{API_ROOT}/projects/{self.project}/aggregated/instances",
        }
        if scoped:
            answer["items"] = scoped
        return answer

    # ----- firewalls

    def _insert_firewall(self, body: bytes, **_: Any) -> dict[str, Any]:
        resource = self._plan_firewall(_json_body(body))
        name = resource["name"]
        with self._lock:
            if name in self._firewalls:
                raise ApiError(
                    HTTPStatus.CONFLICT,
                    "alreadyExists",
                    f"The resource 'projects/{self.project}/global/firewalls/{name}' already exists",
                )
            self._firewalls[name] = resource
            operation = self._new_operation("insert", None, resource["selfLink"], target_id=resource["id"])
            self._finish(operation)
            return self._answer(operation)

    def _plan_firewall(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid(
                f"Invalid value for field 'resource.name': {name!r}. Must be a match of regex "
                "'(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'"
            )
        network = body.get("network") or "global/networks/default"
        short = network
        for prefix in _API_PREFIXES:
            short = short.removeprefix(prefix)
        match = re.fullmatch(r"(?:projects/(?P<project>[^/]+)/)?global/networks/(?P<name>[^/]+)", short)
        if (
            match is None
            or match["project"] not in (None, self.project)
            or not _NAME.fullmatch(match["name"])
        ):
            raise _invalid(f"Invalid value for field 'resource.network': {network!r}")
        if body.get("direction", "INGRESS") != "INGRESS":
            raise _invalid(
                "Invalid value for field 'resource.direction': this fake takes INGRESS rules only."
            )
        if body.get("denied"):
            raise _invalid("Invalid value for field 'resource.denied': this fake takes allow rules only.")
        allowed = body.get("allowed")
        if not isinstance(allowed, list) or not allowed:
            raise _invalid("Invalid value for field 'resource.allowed': at least one rule is required.")
        for i, rule in enumerate(allowed):
            protocol = str(rule.get("IPProtocol", "")) if isinstance(rule, dict) else ""
            if protocol not in _PROTOCOLS and not protocol.isdigit():
                raise _invalid(f"Invalid value for field 'resource.allowed[{i}].IPProtocol': {protocol!r}")
            for port in rule.get("ports") or []:
                ports = _PORT_RANGE.fullmatch(str(port))
                if (
                    protocol not in ("tcp", "udp", "sctp")
                    or ports is None
                    or not (0 < int(ports[1]) <= int(ports[2] or ports[1]) <= 65535)
                ):
                    raise _invalid(f"Invalid value for field 'resource.allowed[{i}].ports': {port!r}")
        source_tags = body.get("sourceTags") or []
        source_ranges = body.get("sourceRanges") or []
        if not source_tags and not source_ranges:
            raise _invalid(
                "Invalid value for field 'resource.sourceRanges': this fake wants sourceTags or "
                "sourceRanges (GCE would take 0.0.0.0/0)."
            )
        for source in source_ranges:
            try:
                ipaddress.ip_network(source, strict=False)
            except ValueError:
                raise _invalid(f"Invalid value for field 'resource.sourceRanges': {source!r}") from None
        target_tags = body.get("targetTags") or []
        if not target_tags:
            raise _invalid(
                "Invalid value for field 'resource.targetTags': this fake wants targetTags (GCE would "
                "apply the rule to every instance of the network)."
            )
        for tag in [*source_tags, *target_tags]:
            if not isinstance(tag, str) or not _NAME.fullmatch(tag):
                raise _invalid(f"Invalid value for field 'resource.sourceTags/targetTags': {tag!r}")
        return {
            **copy.deepcopy(body),
            "kind": "compute#firewall",
            "id": str(next(self._ids)),
            "creationTimestamp": _timestamp(),
            "name": name,
            "network": f"{API_ROOT}/projects/{self.project}/global/networks/{match['name']}",
            "direction": "INGRESS",
            "priority": body.get("priority", 1000),
            "disabled": bool(body.get("disabled", False)),
            "selfLink": f"{API_ROOT}/projects/{self.project}/global/firewalls/{name}",
        }

    def _get_firewall(self, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            if name not in self._firewalls:
                raise _not_found(f"projects/{self.project}/global/firewalls/{name}")
            return copy.deepcopy(self._firewalls[name])

    def _delete_firewall(self, name: str, **_: Any) -> dict[str, Any]:
        with self._lock:
            resource = self._firewalls.pop(name, None)
            if resource is None:
                raise _not_found(f"projects/{self.project}/global/firewalls/{name}")
            operation = self._new_operation("delete", None, resource["selfLink"], target_id=resource["id"])
            self._finish(operation)
            return self._answer(operation)

    def _list_firewalls(self, query: dict[str, str], **_: Any) -> dict[str, Any]:
        matches = compile_filter(query.get("filter"))
        with self._lock:
            items = [copy.deepcopy(f) for f in self._firewalls.values() if matches(f)]
        return _list_answer("compute#firewallList", f"projects/{self.project}/global/firewalls", items)


def _list_answer(kind: str, path: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    answer: dict[str, Any] = {"kind": kind, "id": path, "selfLink": f"{API_ROOT}/{path}"}
    if items:  # GCE leaves "items" out of an empty list
        answer["items"] = items
    return answer


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, "parseError", f"Parse Error: {exc}") from None
    if not isinstance(parsed, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "parseError", "Parse Error: the body is not a JSON object")
    return parsed


def _check_labels(labels: Any, where: str) -> None:
    if not isinstance(labels, dict) or len(labels) > 64:
        raise _invalid(f"Invalid value for field '{where}': at most 64 labels, as an object")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise _invalid(
                f"Invalid value for field '{where}': label key {key!r} (lowercase letters, digits, "
                "- and _, a letter first, at most 63)"
            )
        if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
            raise _invalid(
                f"Invalid value for field '{where}': label value {value!r} of {key!r} (lowercase "
                "letters, digits, - and _, at most 63)"
            )


class _Handler(BaseHTTPRequestHandler):
    server_version = "FakeComputeEngine/1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        fake: FakeComputeEngine = self.server.fake  # type: ignore[attr-defined]
        try:
            status, answer = fake.handle(self.command, self.path, body)
        except Exception as exc:  # a bug of the fake: answer it as GCE would a backend error
            status, answer = (
                HTTPStatus.INTERNAL_SERVER_ERROR,
                ApiError(
                    HTTPStatus.INTERNAL_SERVER_ERROR, "backendError", f"{type(exc).__name__}: {exc}"
                ).body(),
            )
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass
