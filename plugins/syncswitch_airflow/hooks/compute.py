"""Compute Engine for the ``gce`` backend: Airflow's ComputeEngineHook, plus what it lacks.

The provider's hook creates, reads and deletes instances and waits on their operations; this adds
listing a run's instances by label, firewall rules, a non-blocking insert (a replacement requested
from a status poll must not hold the triggerer) and preemption notices.

``api_endpoint`` (or ``$SYNCSWITCH_GCE_API_ENDPOINT``) points every client at another endpoint: a
Private Service Connect endpoint in production, the fake Compute Engine API in the tests
(tests/fake_compute.py). Credentials come from the Airflow connection as usual (the tests use an
anonymous one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from airflow.providers.google.cloud.hooks.compute import ComputeEngineHook
from google.api_core.client_options import ClientOptions
from google.api_core.exceptions import NotFound
from google.cloud import compute_v1
from googleapiclient.discovery import build

ENDPOINT_ENV = "SYNCSWITCH_GCE_API_ENDPOINT"
PREEMPTED = "compute.instances.preempted"


class ComputeHook(ComputeEngineHook):
    """ComputeEngineHook with an optional endpoint, label listing, firewalls and preemption notices."""

    def __init__(self, *, api_endpoint: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_endpoint = (api_endpoint or os.environ.get(ENDPOINT_ENV, "")).rstrip("/")

    # ---- clients: the provider's, pointed at our endpoint when one is set ------------------------------

    def get_client_options(self, api_endpoint_override: str | None = None) -> ClientOptions:
        return super().get_client_options(api_endpoint_override or self.api_endpoint or None)

    def get_conn(self) -> Any:
        """The discovery client the provider waits on operations with; its base URL includes the path."""
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

    def _client(self, cls: type) -> Any:
        return cls(credentials=self.get_credentials(), client_options=self.get_client_options())

    # ---- instances --------------------------------------------------------------------------------

    def request_instance(self, body: compute_v1.Instance, zone: str, project_id: str) -> str:
        """Insert without waiting; returns the operation's name (``wait_zone_operation`` waits)."""
        client = self._client(compute_v1.InstancesClient)
        operation = client.insert(request={"instance_resource": body, "project": project_id, "zone": zone})
        return operation.name

    def wait_zone_operation(self, operation: str, zone: str, project_id: str) -> None:
        """Wait until the operation is done; raises with Compute Engine's error codes if it failed."""
        self._wait_for_operation_to_complete(project_id=project_id, operation_name=operation, zone=zone)

    def find_instance(self, name: str, zone: str, project_id: str) -> compute_v1.Instance | None:
        """The instance, or None when it does not exist (a spot VM may delete itself)."""
        try:
            return self.get_instance(resource_id=name, zone=zone, project_id=project_id)
        except NotFound:
            return None

    def delete_instance_if_exists(self, name: str, zone: str, project_id: str) -> compute_v1.Operation | None:
        """Delete and wait; returns the finished operation (its end_time is when Compute Engine stopped
        billing the VM), or None when the instance was already gone (a spot VM may delete itself)."""
        try:
            operation = self._client(compute_v1.InstancesClient).delete(
                request={"instance": name, "project": project_id, "zone": zone}
            )
        except NotFound:
            return None
        self.wait_zone_operation(operation.name, zone, project_id)
        operations = self._client(compute_v1.ZoneOperationsClient)
        return operations.get(request={"project": project_id, "zone": zone, "operation": operation.name})

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
        self._wait_for_operation_to_complete(project_id=project_id, operation_name=operation.name)

    def delete_firewall_if_exists(self, name: str, project_id: str) -> bool:
        client = self._client(compute_v1.FirewallsClient)
        try:
            operation = client.delete(request={"project": project_id, "firewall": name})
        except NotFound:
            return False
        self._wait_for_operation_to_complete(project_id=project_id, operation_name=operation.name)
        return True

    def firewalls_named(self, project_id: str, prefix: str) -> list[str]:
        client = self._client(compute_v1.FirewallsClient)
        return [f.name for f in client.list(request={"project": project_id}) if f.name.startswith(prefix)]
