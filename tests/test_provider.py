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
