"""Compute Engine for the ``gce`` backend: Airflow's ComputeEngineHook, plus what it lacks.

The provider's hook owns the credentials, the client options and reading instances; this adds
listing a run's instances by label, the SSH host keys a VM publishes, firewall rules, a non-blocking
insert (a replacement requested from a status poll must not hold the triggerer), preemption notices,
and operation waits that are safe from several threads (the provider's share one discovery
connection: see ``get_conn``).

``api_endpoint`` (or ``[syncswitch] gce_api_endpoint``) points every client at another endpoint: a
Private Service Connect endpoint in production, the fake Compute Engine API in the tests
(tests/fake_compute.py). Credentials come from the Airflow connection ``[syncswitch] gcp_conn_id``, the
bucket's too (hooks/bucket.py); the tests use an anonymous one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from airflow.providers.google.cloud.hooks.compute import ComputeEngineHook
from airflow.sdk.exceptions import AirflowException
from google.api_core.client_options import ClientOptions
from google.api_core.exceptions import NotFound
from google.cloud import compute_v1
from googleapiclient.discovery import build

from syncswitch_airflow import settings
from syncswitch_airflow.hooks.bucket import default_conn_id

ENDPOINT_SETTING = "gce_api_endpoint"
PREEMPTED = "compute.instances.preempted"
HOST_KEYS_PATH = "hostkeys/"


class ComputeHook(ComputeEngineHook):
    """ComputeEngineHook with an optional endpoint, label listing, firewalls and preemption notices."""

    def __init__(self, *, api_endpoint: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("gcp_conn_id", default_conn_id())
        super().__init__(**kwargs)
        self.api_endpoint = (api_endpoint or settings.get(ENDPOINT_SETTING) or "").rstrip("/")

    # ---- clients: the provider's, pointed at our endpoint when one is set ------------------------------

    def get_client_options(self, api_endpoint_override: str | None = None) -> ClientOptions:
        return super().get_client_options(api_endpoint_override or self.api_endpoint or None)

    def get_conn(self) -> Any:
        """The provider's discovery client, pointed at our endpoint (its base URL includes the path).
        Nothing of ours waits on it: it holds one httplib2 connection, which is not thread-safe, and
        the backend creates and deletes VMs from several threads at once (two threads' polls on it
        can read each other's answers: IncompleteRead). See ``_wait_for_operation_to_complete``."""
        if not self.api_endpoint:
            return super().get_conn()
        if not self._conn:
            self._conn = build(
                "compute",
                self.api_version,
                http=self._authorize(),
                cache_discovery=False,
                client_options={"api_endpoint": f"{self.api_endpoint}/compute/{self.api_version}/"},
            )
        return self._conn

    def _wait_for_operation_to_complete(
        self, project_id: str, operation_name: str, zone: str | None = None
    ) -> None:
        """The provider's ``insert_instance`` (and its other writes) wait here; its own version polls
        through ``get_conn``'s shared connection. Ours gives each wait a client of its own."""
        if zone is None:
            self.wait_global_operation(operation_name, project_id)
        else:
            self.wait_zone_operation(operation_name, zone, project_id)

    def _client(self, cls: type) -> Any:
        return cls(credentials=self.get_credentials(), client_options=self.get_client_options())

    # ---- instances --------------------------------------------------------------------------------

    def request_instance(self, body: compute_v1.Instance, zone: str, project_id: str) -> str:
        """Insert without waiting; returns the operation's name (``wait_zone_operation`` waits)."""
        client = self._client(compute_v1.InstancesClient)
        operation = client.insert(request={"instance_resource": body, "project": project_id, "zone": zone})
        return operation.name

    def wait_zone_operation(self, operation: str, zone: str, project_id: str) -> compute_v1.Operation:
        """Wait until the zone operation is done and return it; raises with Compute Engine's error codes
        if it failed."""
        client = self._client(compute_v1.ZoneOperationsClient)
        request = {"project": project_id, "zone": zone, "operation": operation}
        return _wait_done(lambda: client.get(request=request))

    def wait_global_operation(self, operation: str, project_id: str) -> compute_v1.Operation:
        """The same for a global operation (firewall rules)."""
        client = self._client(compute_v1.GlobalOperationsClient)
        return _wait_done(lambda: client.get(request={"project": project_id, "operation": operation}))

    def find_instance(self, name: str, zone: str, project_id: str) -> compute_v1.Instance | None:
        """The instance, or None when it does not exist (a spot VM may delete itself)."""
        try:
            return self.get_instance(resource_id=name, zone=zone, project_id=project_id)
        except NotFound:
            return None

    def published_host_keys(self, name: str, zone: str, project_id: str) -> dict[str, str]:
        """The SSH host keys the VM's guest environment published in its guest attributes (namespace
        ``hostkeys``, on first boot, where the instance's metadata has ``enable-guest-attributes``):
        {key type: base64}. Empty until they are published (Compute Engine answers 404 until then)."""
        client = self._client(compute_v1.InstancesClient)
        request = {"instance": name, "project": project_id, "zone": zone, "query_path": HOST_KEYS_PATH}
        try:
            attributes = client.get_guest_attributes(request=request)
        except NotFound:
            return {}
        return {e.key: e.value for e in attributes.query_value.items if e.namespace == "hostkeys"}

    def delete_instance_if_exists(self, name: str, zone: str, project_id: str) -> compute_v1.Operation | None:
        """Delete and wait; returns the finished operation (its end_time is when Compute Engine stopped
        billing the VM), or None when the instance was already gone (a spot VM may delete itself)."""
        try:
            operation = self._client(compute_v1.InstancesClient).delete(
                request={"instance": name, "project": project_id, "zone": zone}
            )
        except NotFound:
            return None
        return self.wait_zone_operation(operation.name, zone, project_id)

    def instances_labelled(self, project_id: str, labels: dict[str, str]) -> Iterator[compute_v1.Instance]:
        """Every instance of the project, in any zone, that carries all of ``labels``."""
        client = self._client(compute_v1.InstancesClient)
        label_filter = " AND ".join(f'labels.{k} = "{v}"' for k, v in sorted(labels.items()))
        pages = client.aggregated_list(request={"project": project_id, "filter": label_filter})
        for _zone, scoped in pages:
            yield from scoped.instances

    def preemptions(self, project_id: str, zone: str) -> list[compute_v1.Operation]:
        """The zone's preemption operations (the notice a revoked spot VM leaves behind)."""
        client = self._client(compute_v1.ZoneOperationsClient)
        request = {"project": project_id, "zone": zone, "filter": f'operationType = "{PREEMPTED}"'}
        return list(client.list(request=request))

    # ---- firewalls --------------------------------------------------------------------------------

    def insert_firewall(self, body: compute_v1.Firewall, project_id: str) -> None:
        """Create the rule and wait; one that exists already (a retried provisioning) is kept."""
        client = self._client(compute_v1.FirewallsClient)
        try:
            client.get(request={"project": project_id, "firewall": body.name})
            return
        except NotFound:
            pass
        operation = client.insert(request={"project": project_id, "firewall_resource": body})
        self.wait_global_operation(operation.name, project_id)

    def delete_firewall_if_exists(self, name: str, project_id: str) -> bool:
        client = self._client(compute_v1.FirewallsClient)
        try:
            operation = client.delete(request={"project": project_id, "firewall": name})
        except NotFound:
            return False
        self.wait_global_operation(operation.name, project_id)
        return True

    def firewalls_named(self, project_id: str, prefix: str) -> list[str]:
        client = self._client(compute_v1.FirewallsClient)
        return [f.name for f in client.list(request={"project": project_id}) if f.name.startswith(prefix)]


OPERATION_POLL_SECONDS = 1.0
OPERATION_TIMEOUT_SECONDS = 900.0


def _wait_done(get: Callable[[], compute_v1.Operation]) -> compute_v1.Operation:
    """Poll an operation until DONE (with a client of the caller's own); AirflowException with Compute
    Engine's codes (e.g. ZONE_RESOURCE_POOL_EXHAUSTED) if it failed, TimeoutError if it never ends."""
    deadline = time.monotonic() + OPERATION_TIMEOUT_SECONDS
    while True:
        operation = get()
        if operation.status == compute_v1.Operation.Status.DONE:
            errors = list(operation.error.errors) if operation.error else []
            if errors:
                described = "; ".join(f"{e.code}: {e.message}" for e in errors)
                status = f"{operation.http_error_status_code} {operation.http_error_message}".strip()
                raise AirflowException(f"{status}: {described}")
            return operation
        if time.monotonic() > deadline:
            raise TimeoutError(f"operation {operation.name} not done after {OPERATION_TIMEOUT_SECONDS:.0f} s")
        time.sleep(OPERATION_POLL_SECONDS)
