"""The Airflow plugin of this provider: a "Report" tab on every DAG run, and the app behind it.

Airflow finds it through the ``airflow.plugins`` entry point (plugins/pyproject.toml), wherever the
distribution is installed: the provider info's ``plugins`` key is read only when
``[core] lazy_discover_providers`` is off, and the plugins folder of a checkout is this package, which
``plugins/.airflowignore`` keeps Airflow's loader out of.

Every Airflow component loads plugins (a task process too, for their macros), so this module imports
nothing heavy: the FastAPI app, with Airflow's API modules, is made where ``fastapi_apps`` is read, the
api-server.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from syncswitch_airflow.ui import REPORT_PAGE, URL_PREFIX

# The UI puts the tab's page in an iframe and fills in {DAG_ID} and {RUN_ID}. A relative href resolves
# against the UI's <base href>, so the tab works under an [api] base_url with a path as well.
REPORT_TAB = {
    "name": "Report",
    "href": f"{URL_PREFIX.lstrip('/')}/runs/{{DAG_ID}}/{{RUN_ID}}/{REPORT_PAGE}",
    "destination": "dag_run",
    "url_route": "syncswitch-report",
}


class SyncSwitchPlugin(AirflowPlugin):
    name = "syncswitch"
    external_views = [REPORT_TAB]

    @property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        from syncswitch_airflow.ui.app import app

        return [{"app": app, "url_prefix": URL_PREFIX, "name": "Sync-Switch run pages"}]
