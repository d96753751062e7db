"""The gce cluster backend: Compute Engine VMs, created for one run and then used as its hosts.

**provision** creates, in the job's project: one firewall rule that lets only the run's VMs reach each
other's ports (TensorFlow's gRPC has no authentication; the VMs have internal addresses only), and the
VMs of ``syncswitch.gce.vm_plan``: the chief VM (worker 0, the only checkpointer) on-demand, the
other workers on spot VMs, the parameter servers on-demand; every VM with a server-side time limit
(``maxRunDuration``, deleted when it runs out) and labels naming the job and the run. A per-run SSH
key goes in the VMs' metadata. Each VM's SSH host key is pinned from what its guest environment
publishes in its guest attributes (Compute Engine's API, not the network, vouches for it; recorded with
the VM in state.json), and a login to a VM that shows another key is refused. When every VM answers
SSH the ``hosts`` backend takes over: fork servers, segments, status and logs are its code. A failed
provisioning deletes what it created.

**Revocation.** Every status poll compares the run's VMs with Compute Engine. A worker VM that is
gone or terminated is recorded as revoked (state.json ``vms`` and ``cluster_events``). In ASP the
launcher goes on with the survivors; in BSP the segment fails and its retry resumes from the last
checkpoint. With ``on_revocation: replace`` a replacement VM is requested at once (without waiting:
the poll runs on the triggerer) and the next launch waits for it; with ``shrink`` the next launch runs
on the survivors, batch and LR recomputed from the active worker count (``SegmentSpec.on_workers``).
The chief VM and the parameter servers (on-demand) are always replaced; while the chief's place is
empty the segment counts as ended (its launcher ran there), so its retry runs on the replacement.

**Teardown** deletes every instance labelled with the run (one already gone counts as deleted) and the
firewall rule, checks by label that nothing is left, and records when each VM ended: the cost ledger
(``syncswitch.costs.ledger``) prices active seconds. ``reap`` deletes what expired or finished runs
left behind (the ``sync_switch_reaper`` DAG runs it).

Settings (``[syncswitch]``, syncswitch_airflow.settings): gce_clusters (clusters at once, default 4),
gce_host_keys (guest-attributes, or accept-any for images without Google's guest environment),
gce_api_endpoint (hooks.compute), and those of the hosts backend.
"""

from __future__ import annotations

import logging
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from google.api_core.exceptions import Conflict
from google.cloud import compute_v1
from syncswitch import state, storage
from syncswitch.errors import SpecError
from syncswitch.gce import (
    LABEL_EXPIRES,
    LABEL_JOB,
    LABEL_RUN,
    GceSpec,
    VmPlan,
    host_role,
    run_label,
    vm_plan,
)
from syncswitch.hosts import HOST_KEY_TYPES, HostSpec, check_host_key
from syncswitch.layout import RunLayout, join
from syncswitch.spec import JobSpec, SegmentSpec

from syncswitch_airflow import metrics, settings
from syncswitch_airflow.backends.base import (
    EXITED,
    ClusterCapacity,
    ClusterError,
    Handle,
    SegmentStatus,
    run_cluster_gone,
)
from syncswitch_airflow.backends.gce_requests import firewall_body, instance_body, vm_metadata
from syncswitch_airflow.backends.hosts import HostsBackend, host_record, host_work_dir
from syncswitch_airflow.backends.node_runtime import runtime_wheel
from syncswitch_airflow.backends.user_requirements import node_requirements
from syncswitch_airflow.hooks.compute import ComputeHook
from syncswitch_airflow.hooks.ssh import HostKeyRefused, SshSession, ensure_private_key, host_key_fingerprint

CAPACITY_SETTING = "gce_clusters"
HOST_KEY_SETTING = "gce_host_keys"
ACCEPT_ANY_HOST_KEY = "accept-any"
HOST_KEY_POLICIES = ("guest-attributes", ACCEPT_ANY_HOST_KEY)
HOST_KEY_POLL_S = 2.0
HOST_KEY_GRACE_S = 30.0  # a VM showing another key than it published is refused after this long
SSH_READY_S = 600.0  # a fresh VM boots and runs its startup script
GONE = ("TERMINATED", "STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED")
REAP_GRACE_S = 600.0  # a run's teardown gets this long before the reaper steps in

log = logging.getLogger(__name__)


# ---- the backend -----------------------------------------------------------------------------------


class GceBackend:
    """VMs on Compute Engine, used as a hosts cluster; holds no state between calls (state.json does)."""

    name = "gce"
    status_poll_seconds = 5.0  # each poll is an SSH login and a Compute Engine list

    def __init__(self, hook: ComputeHook | None = None) -> None:
        self.hosts = HostsBackend()
        self._hook = hook

    @property
    def hook(self) -> ComputeHook:
        if self._hook is None:
            self._hook = ComputeHook()
        return self._hook

    def capacity(self) -> ClusterCapacity:
        return ClusterCapacity.from_setting(self.name, CAPACITY_SETTING, run_cluster_gone)

    # ---- provisioning ----------------------------------------------------------------------------

    def provision(self, job: JobSpec, layout: RunLayout) -> Handle:
        if job.gce is None:
            raise ClusterError("cluster_backend gce needs the gce param")
        run = posixpath.basename(layout.root)
        # Read before anything is taken or created; a replacement VM is then checked as its run began.
        host_keys = settings.get_choice(HOST_KEY_SETTING, HOST_KEY_POLICIES)
        user_requirements = node_requirements(job, install=True)  # what every VM installs, resolved once
        capacity = self.capacity()
        capacity.claim(run, run_dir=layout.root)
        gce = job.gce
        plan = vm_plan(gce, job.job_name, run, job.num_workers, job.num_ps)
        cloud = {
            "project": gce.project,
            "labels": {LABEL_JOB: job.job_name, LABEL_RUN: run_label(run)},
            "tag": f"{plan[0].name.removesuffix('-chief')}-net",
            "firewall": f"{plan[0].name.removesuffix('-chief')}-train",
            "plan": [vm.to_dict() for vm in plan],
            "spec": gce.to_params(),
            "host_keys": host_keys,
            # The run's own SSH key, in its bucket folder: whichever Airflow worker runs a later task
            # of the run logs in with it (layout.cluster_secrets).
            "key": join(layout.cluster_secrets, "ssh_key"),
        }
        try:
            public_key = ensure_private_key(cloud["key"])
            self.hook.insert_firewall(firewall_body(cloud["firewall"], gce, cloud["tag"]), gce.project)
            self._upload_runtime(layout)
            metadata = vm_metadata(gce, layout, public_key, user_requirements)
            self._create_vms(layout, cloud, plan, gce, metadata)
            hosts = _host_specs(cloud, _active_vms(layout, cloud))
            _wait_for_ssh(hosts)
            handle = self.hosts.start_cluster(job, hosts, layout, user_requirements=user_requirements)
        except BaseException as exc:
            log.warning("run %s: provisioning failed (%s); deleting what was created", run, exc)
            self._delete_all(layout, cloud)
            storage.delete_prefix(layout.cluster_secrets)
            capacity.release(run)
            if isinstance(exc, ClusterError):
                raise
            raise ClusterError(f"Compute Engine provisioning failed: {exc}") from exc
        handle.update(backend=self.name, gce=cloud)
        return handle

    @staticmethod
    def _upload_runtime(layout: RunLayout) -> None:
        """What the VMs' startup script installs (backends/gce-startup.sh): this runtime, as it is here."""
        storage.write_bytes(layout.cluster_runtime, runtime_wheel().content)

    def _create_vms(
        self,
        layout: RunLayout,
        cloud: dict[str, Any],
        plan: list[VmPlan],
        gce: GceSpec,
        metadata: dict[str, str],
    ) -> None:
        """Insert every VM at once; wait until each runs. A refused insert (a stock-out) names the VM."""
        labels = {**cloud["labels"], LABEL_EXPIRES: str(int(time.time() + gce.max_run_seconds))}

        def create(vm: VmPlan) -> None:
            _record_requested(layout, vm)
            body = instance_body(vm, gce, labels, cloud["tag"], metadata)
            try:
                self.hook.insert_instance(body=body, zone=vm.zone, project_id=gce.project)
            except Conflict:  # a retried provisioning: this run's VM of that name exists already
                log.info("run %s: VM %s exists already; using it", layout.root, vm.name)
            except Exception as exc:
                state.record_vm(layout, vm.name, state="failed", ended_at=time.time(), error=str(exc)[:300])
                raise ClusterError(
                    f"VM {vm.name} ({vm.machine_type} in {vm.zone}) was refused: {exc}"
                ) from exc
            self._mark_running(layout, vm.name, vm.zone, gce.project)
            log.info("run %s: VM %s running (%s, %s)", layout.root, vm.name, vm.zone, _describe(vm))
            self._pin_host_key(layout, cloud, vm.name, vm.zone)

        with ThreadPoolExecutor(max_workers=min(len(plan), 16)) as pool:
            # Each thread with this task's storage client (the bucket connection's).
            failures = [f.exception() for f in storage.submit_each(pool, create, plan)]
        errors = [str(e) for e in failures if e is not None]
        if errors:
            raise ClusterError("; ".join(errors))

    def _mark_running(self, layout: RunLayout, name: str, zone: str, project: str) -> None:
        """Record that the VM runs, from when, and its internal address (the hosts' address)."""
        instance = self.hook.find_instance(name, zone, project)
        if instance is None or instance.status != "RUNNING" or not instance.network_interfaces:
            raise ClusterError(
                f"VM {name}: {instance.status if instance else 'deleted'} right after its insert"
            )
        address = instance.network_interfaces[0].network_i_p
        # Compute Engine's own start time: what it bills from.
        started = _timestamp(instance.last_start_timestamp or instance.creation_timestamp) or time.time()
        state.record_vm(layout, name, state="running", started_at=started, address=address)

    def _pin_host_key(self, layout: RunLayout, cloud: dict[str, Any], name: str, zone: str) -> None:
        """Wait until the VM publishes its SSH host keys (its guest environment does on first boot) and
        record the preferred one with the VM: every later login, from any Airflow worker, must meet
        it. A VM that publishes none in time fails provisioning, naming the setting that waives it."""
        # A run provisioned before host keys were pinned has no policy in its handle: as it began.
        if cloud.get("host_keys", ACCEPT_ANY_HOST_KEY) == ACCEPT_ANY_HOST_KEY:
            return
        deadline = time.monotonic() + SSH_READY_S
        while not (published := self.hook.published_host_keys(name, zone, cloud["project"])):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"VM {name} published no SSH host key in its guest attributes within "
                    f"{SSH_READY_S:.0f}s: its image needs Google's guest environment, or set "
                    f"[syncswitch] {HOST_KEY_SETTING} = {ACCEPT_ANY_HOST_KEY}"
                )
            time.sleep(HOST_KEY_POLL_S)
        key_type = next((t for t in HOST_KEY_TYPES if t in published), None)
        host_key = f"{key_type} {published[key_type]}" if key_type else ""
        try:
            check_host_key(host_key, f"VM {name}")
        except SpecError:
            raise ClusterError(
                f"VM {name} published no usable SSH host key (types {', '.join(sorted(published))})"
            ) from None
        state.record_vm(layout, name, host_key=host_key)
        log.info("run %s: VM %s host key pinned (%s)", layout.root, name, host_key_fingerprint(host_key))

    # ---- revocations -----------------------------------------------------------------------------

    def check_revocations(self, handle: Handle) -> list[str]:
        """Record every VM of the run that Compute Engine no longer runs; with on_revocation replace,
        request its replacement (not waited for). Returns the names newly found revoked."""
        layout, cloud = RunLayout(handle["run_dir"]), handle["gce"]
        project = cloud["project"]
        live = {i.name: i.status for i in self.hook.instances_labelled(project, cloud["labels"])}
        revoked = []
        for vm in _active_vms(layout, cloud):
            if vm.get("state") != "running" or live.get(vm["name"], "GONE") not in (*GONE, "GONE"):
                continue
            status = live.get(vm["name"], "deleted")
            notice = self._preemption(project, vm)
            stopping = notice is not None and notice.status != compute_v1.Operation.Status.DONE
            if stopping and status != "deleted":
                continue  # recorded at a later poll, with the time its billing ended
            preempted = notice is not None
            # The preemption's own time when there is one: a poll sees it seconds later.
            ended = _timestamp(notice.end_time or notice.insert_time) if notice else None
            state.record_vm(
                layout, vm["name"], state="revoked", ended_at=ended or time.time(), preempted=preempted
            )
            state.record_cluster_event(
                layout, "revoked", vm["name"], role=vm["role"], status=status, preempted=preempted
            )
            _count(metrics.REVOCATIONS, cloud, vm, preempted=str(preempted).lower())
            log.warning(
                "run %s: VM %s (%s %d) revoked: %s%s",
                handle["run"],
                vm["name"],
                vm["role"],
                vm["task"],
                status,
                " (preempted)" if preempted else "",
            )
            revoked.append(vm["name"])
            if cloud["spec"]["on_revocation"] == "replace" or vm["role"] != "worker":
                self._request_replacement(handle, vm)
        return revoked

    def _preemption(self, project: str, vm: dict[str, Any]) -> compute_v1.Operation | None:
        """The preemption notice Compute Engine left for the VM, if it was preempted."""
        for operation in self.hook.preemptions(project, vm["zone"]):
            if operation.target_link.endswith(f"/instances/{vm['name']}"):
                return operation
        return None

    def _request_replacement(self, handle: Handle, vm: dict[str, Any]) -> None:
        layout, cloud = RunLayout(handle["run_dir"]), handle["gce"]
        gce = GceSpec.parse(cloud["spec"], len([p for p in cloud["plan"] if p["role"] != "ps"]))
        assert gce is not None
        attempt = int(vm.get("attempt", 0)) + 1
        new = VmPlan.from_dict(vm).replacement(attempt)
        labels = {**cloud["labels"], LABEL_EXPIRES: str(int(time.time() + gce.max_run_seconds))}
        user_requirements = handle.get("user_requirements", "")
        metadata = vm_metadata(gce, layout, ensure_private_key(cloud["key"]), user_requirements)
        body = instance_body(new, gce, labels, cloud["tag"], metadata)
        _record_requested(layout, new, replaces=vm["name"], attempt=attempt)
        try:
            operation = self.hook.request_instance(body, new.zone, gce.project)
        except Exception as exc:  # a stock-out answers at once; the next launch tries again
            state.record_vm(layout, new.name, state="failed", ended_at=time.time(), error=str(exc)[:300])
            state.record_cluster_event(
                layout, "replacement_failed", new.name, replaces=vm["name"], error=str(exc)[:300]
            )
            _count(metrics.REPLACEMENTS, cloud, vm, outcome="refused")
            log.warning("run %s: replacement %s for %s refused: %s", handle["run"], new.name, vm["name"], exc)
            return
        state.record_vm(layout, new.name, operation=operation)
        _count(metrics.REPLACEMENTS, cloud, vm, outcome="requested")
        log.info("run %s: replacement %s requested for %s", handle["run"], new.name, vm["name"])

    def _await_replacements(self, handle: Handle) -> None:
        """Wait for every requested replacement to run; retry a refused one once more."""
        layout, cloud = RunLayout(handle["run_dir"]), handle["gce"]
        project = cloud["project"]
        vms = state.read_state(layout).get("vms", {})
        for vm in list(vms.values()):
            wanted = cloud["spec"]["on_revocation"] == "replace" or vm["role"] != "worker"
            if wanted and vm.get("state") == "revoked" and not _replacement_of(vms, vm["name"]):
                self._request_replacement(handle, vm)
        for vm in state.read_state(layout).get("vms", {}).values():
            if vm.get("state") != "requested" or not vm.get("replaces"):
                continue
            try:
                if vm.get("operation"):
                    self.hook.wait_zone_operation(vm["operation"], vm["zone"], project)
                self._mark_running(layout, vm["name"], vm["zone"], project)
                self._pin_host_key(layout, cloud, vm["name"], vm["zone"])
                _wait_for_ssh(_host_specs(cloud, [state.read_state(layout)["vms"][vm["name"]]]))
            except Exception as exc:
                state.record_vm(
                    layout, vm["name"], state="failed", ended_at=time.time(), error=str(exc)[:300]
                )
                _count(metrics.REPLACEMENTS, cloud, vm, outcome="failed")
                raise ClusterError(
                    f"replacement VM {vm['name']} for {vm['replaces']} did not start: {exc}"
                ) from exc
            state.record_cluster_event(layout, "replaced", vm["replaces"], by=vm["name"])
            _count(metrics.REPLACEMENTS, cloud, vm, outcome="running")
            log.info(
                "run %s: replacement %s running in place of %s", handle["run"], vm["name"], vm["replaces"]
            )

    # ---- segments: the hosts backend's, on the run's current VMs --------------------------------------

    def current(self, handle: Handle) -> Handle:
        """The handle with the hosts the run has now: replacements in, revoked VMs out."""
        return _on_vms(handle, _active_vms(RunLayout(handle["run_dir"]), handle["gce"]))

    def launch_segment(self, handle: Handle, spec: SegmentSpec) -> dict[str, Any]:
        self.check_revocations(handle)
        self._await_replacements(handle)
        handle = self.current(handle)
        workers = sum(1 for h in handle["hosts"] if h["role"] != "ps")
        if workers < spec.num_workers:
            shrunk = spec.on_workers(workers)
            state.record_cluster_event(
                RunLayout(handle["run_dir"]),
                "shrunk",
                f"segment-{spec.index}-attempt-{int(time.time())}",
                segment=spec.index,
                workers=shrunk.num_workers,
                planned_workers=spec.num_workers,
                hparams=shrunk.hparams,
            )
            log.warning(
                "run %s: segment %d runs on %d of %d workers (%s)",
                handle["run"],
                spec.index,
                shrunk.num_workers,
                spec.num_workers,
                shrunk.hparams,
            )
            spec = shrunk
        return self.hosts.launch_segment(handle, spec)

    def segment_status(self, handle: Handle, index: int) -> SegmentStatus:
        try:
            self.check_revocations(handle)
        except Exception as exc:  # the API is down: the segment's own status still counts
            log.warning("run %s: revocation check failed: %s", handle.get("run"), exc)
        places = _standing_vms(RunLayout(handle["run_dir"]), handle["gce"])
        if places[0] is None:
            # The launcher went with the chief's VM: the segment ended there, without a result, and
            # its retry runs on the replacement (launch_segment waits for it).
            return SegmentStatus(EXITED)
        return self.hosts.segment_status(_on_vms(handle, [vm for vm in places if vm]), index)

    def segment_log_tail(self, handle: Handle, index: int, lines: int = 20) -> str:
        places = _standing_vms(RunLayout(handle["run_dir"]), handle["gce"])
        if places[0] is None:
            return "(the launcher's log went with the chief's VM, which Compute Engine no longer runs)"
        return self.hosts.segment_log_tail(_on_vms(handle, [vm for vm in places if vm]), index, lines)

    def stop_segment(self, handle: Handle, index: int, grace_seconds: float = 30.0) -> list[int]:
        return self.hosts.stop_segment(self.current(handle), index, grace_seconds)

    # ---- teardown --------------------------------------------------------------------------------

    def teardown(self, handle: Handle) -> dict[str, Any]:
        """Upload the VMs' logs the run folder lacks, then delete every VM and the firewall rule of
        the run; verify by label that none is left."""
        layout, cloud = RunLayout(handle["run_dir"]), handle["gce"]
        self._upload_logs(handle)
        deleted = self._delete_all(layout, cloud)
        left = [i.name for i in self.hook.instances_labelled(cloud["project"], cloud["labels"])]
        if left:
            raise ClusterError(f"run {handle['run']}: VMs still exist after teardown: {left}")
        storage.delete_prefix(layout.cluster_secrets)
        self.capacity().release(handle["run"])
        log.info(
            "run %s: teardown deleted %d VM(s) and firewall %s",
            handle["run"],
            len(deleted),
            cloud["firewall"],
        )
        return {"deleted": deleted, "firewall": cloud["firewall"]}

    def _upload_logs(self, handle: Handle) -> None:
        """The running VMs' logs, before their disks go with them (a VM that does not answer is
        skipped: its logs came home with its launcher, or are lost with it)."""
        try:
            self.hosts.upload_logs(self.current(handle))
        except Exception as exc:  # noqa: BLE001 - a log must not keep a VM billed
            log.warning("run %s: the VMs' logs not uploaded: %s", handle.get("run"), exc)

    def _delete_all(self, layout: RunLayout, cloud: dict[str, Any]) -> list[str]:
        """Delete, in parallel, every instance the run recorded or labelled; gone counts as deleted."""
        project = cloud["project"]
        recorded = (state.read_state(layout) or {}).get("vms", {})
        targets = {name: vm["zone"] for name, vm in recorded.items()}
        for instance in self.hook.instances_labelled(project, cloud["labels"]):
            targets[instance.name] = instance.zone.rsplit("/", 1)[-1]

        def delete(name: str) -> str:
            done = self.hook.delete_instance_if_exists(name, targets[name], project)
            if recorded.get(name, {}).get("state") in ("running", "requested"):
                # Compute Engine's end of the deletion, not this poll's: the ledger bills what GCE bills.
                ended = _timestamp(done.end_time) if done is not None else None
                state.record_vm(layout, name, state="deleted", ended_at=ended or time.time())
            return name

        with ThreadPoolExecutor(max_workers=max(min(len(targets), 16), 1)) as pool:
            deleted = [f.result() for f in storage.submit_each(pool, delete, sorted(targets))]
        self.hook.delete_firewall_if_exists(cloud["firewall"], project)
        return deleted

    # ---- reaper ----------------------------------------------------------------------------------

    def reap(self, project: str, now: float | None = None) -> list[str]:
        """Delete the sync-switch VMs of ``project`` whose time limit passed, or whose run ended more
        than ``REAP_GRACE_S`` ago (its state.json, found through the VM's metadata, says so); returns
        their names. Firewall rules with no VM of their run left go too."""
        now = time.time() if now is None else now
        reaped, alive = [], set()
        for instance in self.hook.instances_labelled(project, {}):
            labels = dict(instance.labels)
            if LABEL_RUN not in labels:
                continue
            reason = _reap_reason(instance, labels, now)
            if reason:
                zone = instance.zone.rsplit("/", 1)[-1]
                self.hook.delete_instance_if_exists(instance.name, zone, project)
                log.info("reaper: deleted %s (%s)", instance.name, reason)
                reaped.append(instance.name)
            else:
                alive.add(next((t for t in instance.tags.items if t.endswith("-net")), ""))
        for rule in self.hook.firewalls_named(project, "ss-"):
            if rule.endswith("-train") and f"{rule.removesuffix('-train')}-net" not in alive:
                self.hook.delete_firewall_if_exists(rule, project)
                log.info("reaper: deleted firewall %s (no VM of its run is left)", rule)
        log.info("reaper: %d VM(s) deleted in %s", len(reaped), project)
        return reaped


def _reap_reason(instance: compute_v1.Instance, labels: dict[str, str], now: float) -> str:
    """Why a run's VM should not exist any more ("" = it should)."""
    if float(labels.get(LABEL_EXPIRES, "inf")) <= now:
        return "its time limit passed"
    metadata = {item.key: item.value for item in instance.metadata.items}
    runtime = metadata.get("syncswitch-runtime", "")
    run = RunLayout.of_cluster_runtime(runtime)  # the metadata names the run's folder
    if run is None:
        return ""
    run_state = state.read_state(run) or {}
    finished = run_state.get("timings", {}).get("finished")
    if run_state.get("status") in ("success", "failed") and finished and now - finished > REAP_GRACE_S:
        return f"its run ended ({run_state['status']}) {now - finished:.0f}s ago"
    return ""


# ---- helpers ---------------------------------------------------------------------------------------


def _count(metric: metrics.Metric, cloud: dict[str, Any], vm: dict[str, Any], **tags: str) -> None:
    """One VM's revocation or replacement step, as a metric of the job the run's labels name (known
    from provisioning on, before the run's state is)."""
    job = cloud.get("labels", {}).get(LABEL_JOB)
    metrics.send(metric, 1, job_name=job, backend="gce", role=vm.get("role"), **tags)


def _record_requested(layout: RunLayout, vm: VmPlan, **more: Any) -> None:
    """The VM's record in state.json, requested now: its plan's fields (VmPlan.to_dict), then ``more``."""
    fields = vm.to_dict()
    state.record_vm(layout, fields.pop("name"), **fields, state="requested", requested_at=time.time(), **more)


def _replacement_of(vms: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    for vm in vms.values():
        if vm.get("replaces") == name and vm.get("state") != "failed":
            return vm
    return None


def _active_vms(layout: RunLayout, cloud: dict[str, Any]) -> list[dict[str, Any]]:
    """The VM standing in each planned place now; a place with no running VM is left out."""
    return [vm for vm in _standing_vms(layout, cloud) if vm is not None]


def _standing_vms(layout: RunLayout, cloud: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Per planned place (the plan's order: the chief's first), the VM standing in it now: the planned
    one, or its latest replacement that runs; None where none runs (revoked, not replaced yet)."""
    vms = (state.read_state(layout) or {}).get("vms", {})
    return [_standing_vm(vms, planned["name"]) for planned in cloud["plan"]]


def _on_vms(handle: Handle, vms: list[dict[str, Any]]) -> Handle:
    """The handle with ``vms`` as its hosts (the records of hosts it has already, new ones made)."""
    cloud = handle["gce"]
    known = {h["name"]: h for h in handle["hosts"]}
    job, run = cloud["labels"][LABEL_JOB], handle["run"]
    hosts = [
        known.get(spec.label) or host_record(spec, host_work_dir(spec, job, run))
        for spec in _host_specs(cloud, vms)
    ]
    return {**handle, "hosts": hosts}


def _standing_vm(vms: dict[str, dict[str, Any]], planned: str) -> dict[str, Any] | None:
    """The running VM in the place of the planned VM ``planned``, or None while it has none."""
    current = vms.get(planned)
    while current is not None and current.get("state") == "revoked":
        current = _replacement_of(vms, current["name"])
    return current if current is not None and current.get("state") == "running" else None


def _describe(vm: VmPlan) -> str:
    gpu = f", {vm.gpu.count} x {vm.gpu.type}" if vm.gpu.type else ""
    return f"{vm.machine_type}{gpu}, {'spot' if vm.spot else 'on-demand'}"


def _timestamp(text: str) -> float | None:
    """Compute Engine's RFC 3339 times ("2026-11-23T15:04:05.123-08:00") as epoch seconds."""
    try:
        return datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


def _host_specs(cloud: dict[str, Any], vms: list[dict[str, Any]]) -> tuple[HostSpec, ...]:
    """Running VMs as hosts of the hosts backend (their address is recorded when they start)."""
    gce = cloud["spec"]
    return tuple(
        HostSpec(
            address=vm["address"],
            key=cloud["key"],
            user=gce["ssh_user"],
            role=host_role(vm["role"]),
            python=gce["python"],
            name=vm["name"],
            host_key=vm.get("host_key", ""),
        )
        for vm in vms
    )


def _wait_for_ssh(hosts: tuple[HostSpec, ...]) -> None:
    """Until every host takes an SSH login and has the runtime (a VM boots, then its startup script
    installs it). A host that shows another host key than its pinned one fails it after a short
    grace (the guest environment may restart sshd with its new keys just after publishing them)."""
    deadline, last_reason = time.monotonic() + SSH_READY_S, ""
    for host in hosts:
        refused_since: float | None = None
        record = {
            "name": host.label,
            "address": host.address,
            "port": host.port,
            "user": host.user,
            "key": host.key,
            "host_key": host.host_key,
        }
        while True:
            try:
                with SshSession(record, timeout=5.0) as ssh:
                    code, _, _ = ssh.run(f"{host.python} -c 'import syncswitch.forkserver'")
                if code == 0:
                    break
                reason = f"the runtime is not installed at {host.python} yet"
            except HostKeyRefused as exc:
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since > HOST_KEY_GRACE_S:
                    raise
                reason = str(exc)
            except ClusterError as exc:
                reason = str(exc)
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"VM {host.label} did not take an SSH login within {SSH_READY_S:.0f}s: {reason}"
                )
            if reason != last_reason:
                log.info("waiting for VM %s: %s", host.label, reason)
                last_reason = reason
            time.sleep(2.0)
