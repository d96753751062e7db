"""What ``airflow providers list`` shows of this package (the ``apache_airflow_provider`` entry point).

Airflow's providers manager loads :func:`get_provider_info` from every installed distribution that
declares the entry point, checks it against ``airflow/provider_info.schema.json`` and requires its
``package-name`` to be the distribution's own name.
"""

from __future__ import annotations

from typing import Any

from syncswitch_airflow.links import RUN_LINKS
from syncswitch_airflow.settings import provider_config

PACKAGE_NAME = "airflow-provider-syncswitch"  # the distribution (plugins/pyproject.toml [project] name)
INTEGRATION = "Sync-Switch"
OPERATOR_MODULES = ("cluster", "job", "segment", "timing", "finalize")
TRIGGER_MODULES = ("capacity", "segment", "straggler")


def get_provider_info() -> dict[str, Any]:
    modules = "syncswitch_airflow.{}".format
    return {
        "package-name": PACKAGE_NAME,
        "name": INTEGRATION,
        "description": (
            "Sync-Switch (ICDCS'21) on Airflow: TensorFlow training that switches between synchronous "
            "(BSP) and asynchronous (ASP) data parallelism, with straggler-aware online policies and "
            "an offline search for the switch point of recurring jobs."
        ),
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://arxiv.org/abs/2104.08364",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [modules(f"operators.{name}") for name in OPERATOR_MODULES],
            }
        ],
        "sensors": [{"integration-name": INTEGRATION, "python-modules": [modules("sensors.straggler")]}],
        "hooks": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [modules(f"hooks.{name}") for name in ("bucket", "compute", "ssh")],
            }
        ],
        "triggers": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [modules(f"triggers.{name}") for name in TRIGGER_MODULES],
            }
        ],
        "extra-links": [f"{type(link).__module__}.{type(link).__qualname__}" for link in RUN_LINKS],
        "config": provider_config(),
    }
