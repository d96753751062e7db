"""What the gce backend asks Compute Engine for: a run's VMs, its firewall rule, a VM's metadata.

The requests are built as compute_v1 objects, so that a wrong field name fails when it is built, not
when Compute Engine refuses it; nothing here calls Compute Engine (``backends.gce`` does).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from google.cloud import compute_v1
from syncswitch.gce import LABEL_ROLE, GceSpec, VmPlan
from syncswitch.layout import RunLayout
from syncswitch.requirements import requirements_text

from syncswitch_airflow.backends.node_runtime import NODE_INSTALL_SCRIPT

# Found beside the code, so that an installed package (site-packages) works as a checkout does.
STARTUP_SCRIPT = Path(__file__).resolve().with_name("gce-startup.sh")


def instance_body(
    vm: VmPlan, gce: GceSpec, labels: dict[str, str], tag: str, metadata: dict[str, str]
) -> compute_v1.Instance:
    """One VM: spot or on-demand, its GPUs, internal address only, a server-side time limit."""
    project, zone = gce.project, vm.zone
    region = zone.rsplit("-", 1)[0]
    interface = compute_v1.NetworkInterface(network=f"projects/{project}/global/networks/{gce.network}")
    if gce.subnetwork:
        interface.subnetwork = f"projects/{project}/regions/{region}/subnetworks/{gce.subnetwork}"
    scheduling = compute_v1.Scheduling(
        provisioning_model="SPOT" if vm.spot else "STANDARD",
        # DELETE: a preempted or timed-out VM takes its disk with it (nothing left to pay for).
        instance_termination_action="DELETE",
        max_run_duration=compute_v1.Duration(seconds=gce.max_run_seconds),
        # VMs with GPUs cannot live-migrate; spot VMs cannot restart on their own.
        on_host_maintenance="TERMINATE" if vm.gpu.type or vm.spot else "MIGRATE",
        automatic_restart=not vm.spot,
    )
    body = compute_v1.Instance(
        name=vm.name,
        machine_type=f"zones/{zone}/machineTypes/{vm.machine_type}",
        labels={**labels, LABEL_ROLE: vm.role},
        tags=compute_v1.Tags(items=[tag]),
        scheduling=scheduling,
        network_interfaces=[interface],
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=gce.image, disk_size_gb=gce.disk_gb
                ),
            )
        ],
        metadata=compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]),
        service_accounts=[
            # The bucket is the cluster's only shared storage.
            compute_v1.ServiceAccount(
                email="default", scopes=["https://www.googleapis.com/auth/cloud-platform"]
            )
        ],
    )
    if vm.gpu.type:
        body.guest_accelerators = [
            compute_v1.AcceleratorConfig(
                accelerator_type=f"projects/{project}/zones/{zone}/acceleratorTypes/{vm.gpu.type}",
                accelerator_count=vm.gpu.count,
            )
        ]
    return body


def firewall_body(name: str, gce: GceSpec, tag: str) -> compute_v1.Firewall:
    """Every TCP port of the run's VMs, open to the run's VMs only (TensorFlow's ports are random)."""
    return compute_v1.Firewall(
        name=name,
        network=f"projects/{gce.project}/global/networks/{gce.network}",
        direction="INGRESS",
        priority=1000,
        allowed=[compute_v1.Allowed(I_p_protocol="tcp")],
        source_tags=[tag],
        target_tags=[tag],
        description="sync-switch training traffic between the VMs of one run",
    )


def vm_metadata(
    gce: GceSpec, layout: RunLayout, public_key: str, user_requirements: str = ""
) -> dict[str, str]:
    """The per-run login, and what the startup script installs the runtime from: with
    ``user_requirements`` (the user code's list, resolved), those too."""
    metadata = {
        "ssh-keys": f"{gce.ssh_user}:{public_key}",
        "block-project-ssh-keys": "true",
        # The guest environment then publishes the VM's SSH host keys (pinned by _pin_host_key).
        "enable-guest-attributes": "TRUE",
        "startup-script": STARTUP_SCRIPT.read_text(),
        "syncswitch-runtime": layout.cluster_runtime,
        "syncswitch-python": gce.python,
        # The runtime's dependencies at the lock's versions (well under metadata's 256 KB limit),
        # and the installer the hosts backend runs on its hosts too.
        "syncswitch-requirements": requirements_text(),
        "syncswitch-install": NODE_INSTALL_SCRIPT.read_text(),
        # An image without uv, or without the lock's Python, gets this uv first: the Airflow side's.
        "syncswitch-uv": f"uv=={importlib.metadata.version('uv')}",
    }
    if user_requirements:
        metadata["syncswitch-user-requirements"] = user_requirements
    return metadata
