"""Deployment settings: the provider's ``[syncswitch]`` config section, declared once.

Each setting is read, in this order, from:

1. ``$SYNCSWITCH_<KEY>`` (the environment variables of deployments from before the config section);
2. Airflow's configuration: ``AIRFLOW__SYNCSWITCH__<KEY>`` or ``[syncswitch] <key>`` in airflow.cfg,
   which the Airflow UI's configuration page shows (the provider info declares the section);
3. the setting's default.

The table below is the one place a setting is named: the provider info's ``config`` section and the
docs' table are made from it. Settings are read on every call (never cached in the module), so a
test or an operator that changes the environment is heard at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

SECTION = "syncswitch"
LEGACY_PREFIX = "SYNCSWITCH_"
VERSION_ADDED = "0.1.0"


class SettingError(ValueError):
    """A setting's value is not of its type; names the setting and where it came from."""


@dataclass(frozen=True)
class Setting:
    key: str
    description: str
    type: str = "string"  # "string" | "integer" | "float" (Airflow's option types)
    default: str | None = None
    example: str | None = None

    @property
    def env(self) -> str:
        """The setting's own environment variable, still accepted."""
        return LEGACY_PREFIX + self.key.upper()

    @property
    def airflow_env(self) -> str:
        return f"AIRFLOW__{SECTION.upper()}__{self.key.upper()}"

    def provider_option(self) -> dict[str, Any]:
        return {
            "description": f"{self.description} (also ${self.env}, which wins where set)",
            "version_added": VERSION_ADDED,
            "type": self.type,
            "example": self.example,
            "default": self.default,
        }


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "bucket_dir",
        "Default bucket folder of the runs (local folder or gs:// URI); empty: <project>/runs",
        example="gs://my-bucket/syncswitch",
    ),
    Setting(
        "default_params",
        "A YAML file of job params (JobSpec fields) that the ad-hoc sync_switch DAG's Trigger form, "
        "REST conf and syncswitch run default to: a deployment's cluster backend, hosts and bucket; "
        "empty: the built-in digits demo on a local cluster",
        example="/opt/airflow/config/default-params.yaml",
    ),
    Setting(
        "jobs_dir",
        "Folder of the recurring job files (one DAG per file); empty: <project>/jobs",
        example="/opt/airflow/syncswitch-jobs",
    ),
    Setting(
        "work_dir",
        "Work folder of the Airflow worker for cluster bookkeeping (leases, fork servers); "
        "empty: <tmp>/syncswitch",
        example="/var/lib/syncswitch",
    ),
    Setting(
        "leases_dir",
        "Folder of the hosts and gce capacity ledgers, which every Airflow worker must reach: on a "
        "distributed Airflow (no shared disk) a gs:// folder; empty: <work_dir>/leases",
        example="gs://my-bucket/syncswitch/_leases",
    ),
    Setting(
        "gcp_conn_id",
        "Airflow connection of the Airflow side's Google calls: the run bucket (state, reports, "
        "history, ledgers) and Compute Engine. Where the default id names no connection, the "
        "worker's default credentials; training nodes always use their own",
        default="google_cloud_default",
        example="my_gcp_connection",
    ),
    Setting("local_clusters", "How many local clusters may exist at once", "integer", "1"),
    Setting(
        "local_standby_forkserver",
        "1: the embedded Airflow's executor keeps a fork server with TensorFlow imported for the next "
        "local cluster (about 0.5 GB of memory while idle), so its first segment starts without "
        "waiting for the import; 0: each local cluster starts its own",
        "integer",
        "1",
    ),
    Setting("hosts_clusters", "How many clusters of hosts may exist at once", "integer", "1"),
    Setting("gce_clusters", "How many Compute Engine clusters may exist at once", "integer", "4"),
    Setting(
        "ssh_known_hosts",
        "known_hosts file for the hosts and gce backends; when set, unknown host keys are refused",
        example="/etc/ssh/ssh_known_hosts",
    ),
    Setting(
        "gce_host_keys",
        "How the gce backend knows its VMs' SSH host keys: 'guest-attributes' (each VM publishes them "
        "on first boot, as Google's guest environment does; the run pins one and refuses any other) "
        "or 'accept-any' (images without the guest environment: any key, with a warning)",
        default="guest-attributes",
        example="accept-any",
    ),
    Setting(
        "hosts_runtime",
        "How the hosts backend's hosts get the training runtime: 'installed' (they have it at their "
        "python=, checked against the lock) or 'install' (installed over SSH, once per version, into "
        "<work_root>/runtime/<id> on each host: uv where on PATH, else pip)",
        default="installed",
        example="install",
    ),
    Setting(
        "hosts_env",
        "K=V;K=V set for every process on the cluster's hosts (the GCS emulator, a project)",
        example="STORAGE_EMULATOR_HOST=http://10.0.0.1:4443;GOOGLE_CLOUD_PROJECT=demo",
    ),
    Setting(
        "gce_api_endpoint",
        "Another Compute Engine API endpoint (a fake one in tests); empty: Google's",
        example="http://127.0.0.1:8089",
    ),
)

_BY_KEY = {setting.key: setting for setting in SETTINGS}


def setting(key: str) -> Setting:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no [{SECTION}] setting {key!r}; settings: {', '.join(_BY_KEY)}") from None


def get(key: str) -> str | None:
    """The setting's value (step 1, 2, then 3 of the module's order); None where all are empty."""
    declared = setting(key)
    legacy = os.environ.get(declared.env)
    if legacy:
        return legacy
    from airflow.sdk.configuration import conf  # lazy: the first read parses airflow.cfg

    value = conf.get(SECTION, key, fallback=None)
    return value if value not in (None, "") else declared.default


def get_int(key: str) -> int:
    raw = get(key)
    try:
        return int(str(raw))
    except ValueError:
        declared = setting(key)
        raise SettingError(
            f"[{SECTION}] {key} (${declared.env} or ${declared.airflow_env}) must be an integer, got {raw!r}"
        ) from None


def get_choice(key: str, choices: tuple[str, ...]) -> str:
    """The setting's value, which must be one of ``choices``."""
    raw = get(key) or ""
    if raw not in choices:
        declared = setting(key)
        raise SettingError(
            f"[{SECTION}] {key} (${declared.env} or ${declared.airflow_env}) must be one of "
            f"{', '.join(choices)}, got {raw!r}"
        )
    return raw


def provider_config() -> dict[str, Any]:
    """The ``config`` entry of the provider info."""
    return {
        SECTION: {
            "description": "Deployment settings of Sync-Switch pipelines (the Airflow side).",
            "options": {s.key: s.provider_option() for s in SETTINGS},
        }
    }
