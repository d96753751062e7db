"""The package as an Airflow provider: its provider info is valid, names modules that import, and the
real `airflow providers list` shows it (found through the apache_airflow_provider entry point)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import airflow
import pytest
from syncswitch_airflow import settings
from syncswitch_airflow.provider_info import PACKAGE_NAME, get_provider_info

AIRFLOW = Path(sys.executable).parent / "airflow"


def test_the_provider_info_is_valid_and_its_modules_import() -> None:
    import jsonschema

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == PACKAGE_NAME == metadata.distribution(PACKAGE_NAME).metadata["Name"]
    for kind in ("operators", "sensors", "hooks", "triggers"):
        for entry in info[kind]:
            for module in entry["python-modules"]:
                importlib.import_module(module)


def test_airflow_providers_list_shows_it(tmp_path: Path) -> None:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path)}
    done = subprocess.run(
        [str(AIRFLOW), "providers", "list", "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listed = {p["package_name"]: p for p in json.loads(done.stdout[done.stdout.index("[") :])}
    assert PACKAGE_NAME in listed, sorted(listed)
    assert listed[PACKAGE_NAME]["description"].startswith("Sync-Switch (ICDCS'21) on Airflow")
    assert listed[PACKAGE_NAME]["version"] == metadata.version(PACKAGE_NAME)

    # Airflow's own configuration knows the [syncswitch] section: its defaults, and its variables.
    def config_value(key: str, **extra: str) -> str:
        argv = [str(AIRFLOW), "config", "get-value", settings.SECTION, key]
        done = subprocess.run(argv, env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    assert config_value("gce_clusters") == "4"
    assert config_value("gce_clusters", AIRFLOW__SYNCSWITCH__GCE_CLUSTERS="7") == "7"


def test_airflow_plugins_shows_the_report_tab_and_its_app(tmp_path: Path) -> None:
    """Airflow finds the plugin through the distribution's airflow.plugins entry point, as any
    component does where the provider is installed: a Report tab on DAG runs, its app under /syncswitch."""
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    done = subprocess.run(
        [str(AIRFLOW), "plugins", "--output", "json"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plugins = {p["name"]: p for p in json.loads(done.stdout[done.stdout.index("[") :])}
    plugin = plugins["syncswitch"]
    assert plugin["source"].startswith(f"{PACKAGE_NAME}==")
    assert plugin["external_views"] == [
        {
            "name": "Report",
            "href": "syncswitch/runs/{DAG_ID}/{RUN_ID}/report/",
            "destination": "dag_run",
            "url_route": "syncswitch-report",
        }
    ]
    assert [(a["url_prefix"], a["app"]) for a in plugin["fastapi_apps"]] == [
        ("/syncswitch", "fastapi.applications.FastAPI")
    ]


def test_a_setting_comes_from_its_old_variable_then_the_config_section_then_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hosts_clusters = settings.setting("hosts_clusters")
    assert (hosts_clusters.env, hosts_clusters.airflow_env) == (
        "SYNCSWITCH_HOSTS_CLUSTERS",
        "AIRFLOW__SYNCSWITCH__HOSTS_CLUSTERS",
    )
    monkeypatch.delenv(hosts_clusters.env, raising=False)
    monkeypatch.delenv(hosts_clusters.airflow_env, raising=False)
    assert settings.get_int("hosts_clusters") == 1
    monkeypatch.setenv(hosts_clusters.airflow_env, "3")
    assert settings.get_int("hosts_clusters") == 3
    monkeypatch.setenv(hosts_clusters.env, "5")  # a deployment from before the section: still heard
    assert settings.get_int("hosts_clusters") == 5
    monkeypatch.setenv(hosts_clusters.env, "many")
    with pytest.raises(settings.SettingError, match=r"\[syncswitch\] hosts_clusters .*got 'many'"):
        settings.get_int("hosts_clusters")
    with pytest.raises(KeyError, match="no \\[syncswitch\\] setting 'clusters'; settings: bucket_dir"):
        settings.get("clusters")


def test_the_docs_list_every_setting() -> None:
    """The install guide's table is the settings table's: no setting missing, none made up."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "install-into-airflow.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert rows == {s.key for s in settings.SETTINGS}


def test_run_links_point_at_the_plugins_pages_on_the_api_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tasks' extra links (the embedded Airflow end-to-end test reads them through the REST API): the
    plugin's pages of the run under ``[api] base_url``, whatever and wherever the bucket is."""
    from types import SimpleNamespace

    from syncswitch_airflow.links import RUN_LINKS

    run = SimpleNamespace(dag_id="sync_switch", run_id="manual__2026-11-25T10:00:00+00:00")

    def links(run_dir: object) -> dict[str, str]:
        return {link.name: link.get_link(SimpleNamespace(run_dir=run_dir), ti_key=run) for link in RUN_LINKS}

    server = "https://airflow.example.com/team"
    run_path = "/syncswitch/runs/sync_switch/manual__2026-11-25T10%3A00%3A00%2B00%3A00"
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", f"{server}/")
    remote = links("gs://my-bucket/runs/job/manual__2026-11-25T10_00_00_00_00")
    assert remote == {
        "Run report": f"{server}{run_path}/report/",
        "Run bucket folder": f"{server}{run_path}/folder",
        "TensorBoard logs": f"{server}{run_path}/folder#tensorboard",
    }
    assert links("/data/runs/job/a run") == remote
    # Without a base_url, a path from the api-server's root: the UI opens it on its own origin.
    monkeypatch.delenv("AIRFLOW__API__BASE_URL")
    assert links("/data/runs/job/a run")["Run report"] == f"{run_path}/report/"
    # Before the plan task has made the run folder, the template renders to nothing: no link.
    assert set(links("None").values()) == set(links(None).values()) == {""}
    info = get_provider_info()
    assert info["extra-links"] == [f"syncswitch_airflow.links.{type(link).__name__}" for link in RUN_LINKS]
