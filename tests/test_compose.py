"""Deployment files, validated without a Docker engine.

docker-compose.yaml goes through the real compose v2 binary (``config`` checks schema, types and
references without a daemon); the Dockerfiles are parsed and checked against the repository, the
compose file and .dockerignore; the airflow-init snippets are run against the GCS emulator.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import compose
import pytest
import yaml
from syncswitch import storage

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "docker-compose.yaml"
AIRFLOW_DOCKERFILE = REPO / "images" / "Dockerfile.airflow"
TRAINER_DOCKERFILE = REPO / "images" / "Dockerfile.trainer"
AIRFLOW_SERVICES = ("airflow-init", "api-server", "scheduler", "dag-processor", "triggerer", "airflow-worker")
LONG_RUNNING = (
    *("postgres", "redis", "fake-gcs", "api-server", "scheduler", "dag-processor", "triggerer"),
    "airflow-worker",
)
# Top-level modules the trainer image provides: tensorflow-cpu (with keras), numpy, scikit-learn,
# google-cloud-storage (google.cloud, google.auth, google.api_core).
# google-cloud-storage brings requests and urllib3 (its transport); storage.py names their errors.
TRAINER_RUNTIME_MODULES = {
    *("tensorflow", "keras", "numpy", "sklearn", "google", "requests", "urllib3", "tensorflow_datasets"),
}


def compose_binary() -> Path:
    # The pip wrapper (`docker-compose` script) always exits 0; the bundled binary reports errors.
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), f"compose binary missing at {binary}"
    return binary


def run_compose(compose_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A fixed environment: the file's ${VAR:-default} values must not depend on the caller's shell.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(compose_file.parent)}
    command = [str(compose_binary()), "-f", str(compose_file), "--project-directory", str(REPO), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The resolved compose model (anchors merged, defaults interpolated), trainer profile included."""
    result = run_compose(COMPOSE_FILE, "--profile", "trainer", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- compose: validity --------------------------------------------------------------------------


def test_compose_file_is_valid() -> None:
    result = run_compose(COMPOSE_FILE, "config", "--quiet")
    assert result.returncode == 0, result.stderr


def _missing_dependency(doc: dict[str, Any]) -> None:
    doc["services"]["scheduler"]["depends_on"]["no-such-service"] = {"condition": "service_healthy"}


def _bad_type(doc: dict[str, Any]) -> None:
    doc["services"]["postgres"]["healthcheck"]["retries"] = "many"


def _unknown_key(doc: dict[str, Any]) -> None:
    doc["services"]["triggerer"]["commandd"] = ["airflow", "triggerer"]


def _bad_condition(doc: dict[str, Any]) -> None:
    doc["services"]["api-server"]["depends_on"]["postgres"]["condition"] = "service_ready"


def _unchanged(doc: dict[str, Any]) -> None:
    pass


def _write_copy(tmp_path: Path, mutate: Callable[[dict[str, Any]], None]) -> Path:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())  # merges the x-airflow-common anchors
    mutate(doc)
    path = tmp_path / "docker-compose.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_round_tripped_copy_is_still_valid(tmp_path: Path) -> None:
    # Control for the test below: its copies fail because of the mutation, not the round trip.
    result = run_compose(_write_copy(tmp_path, _unchanged), "config", "--quiet")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("mutate", "complaint"),
    [
        (_missing_dependency, "no-such-service"),
        (_bad_type, "retries"),
        (_unknown_key, "commandd"),
        (_bad_condition, "condition"),
    ],
    ids=["missing-dependency", "bad-type", "unknown-key", "bad-condition"],
)
def test_broken_copies_are_rejected(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], None], complaint: str
) -> None:
    result = run_compose(_write_copy(tmp_path, mutate), "config", "--quiet")
    assert result.returncode != 0
    assert complaint in result.stderr, result.stderr


# --- compose: content ---------------------------------------------------------------------------


def test_expected_services_exist(config: dict[str, Any]) -> None:
    assert set(config["services"]) == {"postgres", "redis", "fake-gcs", "trainer", *AIRFLOW_SERVICES}
    assert config["services"]["trainer"]["profiles"] == ["trainer"]
    # without the profile, the trainer is not started by `docker compose up`
    result = run_compose(COMPOSE_FILE, "config", "--services")
    assert result.returncode == 0, result.stderr
    assert "trainer" not in result.stdout.split()


def test_airflow_services_share_image_and_settings(config: dict[str, Any]) -> None:
    secrets = set()
    for name in AIRFLOW_SERVICES:
        service = config["services"][name]
        assert Path(service["build"]["dockerfile"]).name == "Dockerfile.airflow", name
        env = service["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert (
            env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://")
            and "@redis:6379/" in env["AIRFLOW__CELERY__BROKER_URL"]
        ), name
        assert env["AIRFLOW__SYNCSWITCH__LEASES_DIR"].startswith("gs://"), name  # shared by every worker
        warm = "syncswitch_airflow.celery_config.CELERY_CONFIG"  # tasks start with Airflow's parsing imported
        assert env["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"] == warm, name
        # One Fernet key, one JWT secret and one API secret key for all: a connection saved by the UI
        # is read by a task, and the api-server may fetch a task's log from the worker that ran it.
        secrets.add(
            (
                env["AIRFLOW__CORE__FERNET_KEY"],
                env["AIRFLOW__API_AUTH__JWT_SECRET"],
                env["AIRFLOW__API__SECRET_KEY"],
            )
        )
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://"), name
        assert "@postgres:5432/" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], name
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "false", name
        assert int(env["AIRFLOW__CORE__PARALLELISM"]) >= 1, name
        assert env["STORAGE_EMULATOR_HOST"] == "http://fake-gcs:4443", name
        assert env["AIRFLOW__API_AUTH__JWT_SECRET"], name
    assert len(secrets) == 1
    from cryptography.fernet import Fernet

    Fernet(secrets.pop()[0])  # a valid key
    commands = {name: config["services"][name]["command"][:3] for name in AIRFLOW_SERVICES[1:]}
    assert commands == {
        "api-server": ["airflow", "api-server", "--port"],
        "scheduler": ["airflow", "scheduler"],
        "dag-processor": ["airflow", "dag-processor"],
        "triggerer": ["airflow", "triggerer"],
        "airflow-worker": ["airflow", "celery", "worker"],
    }


def test_workers_share_no_disk(config: dict[str, Any]) -> None:
    """Two workers, each with only its container's own filesystem: nothing mounted that another
    component also mounts (the bucket is how they share)."""
    services = config["services"]
    assert services["airflow-worker"]["deploy"]["replicas"] >= 2
    assert not services["airflow-worker"].get("volumes")
    for name in ("scheduler", "triggerer", "dag-processor"):
        assert not services[name].get("volumes"), name


def test_dependencies_wait_for_health_and_init(config: dict[str, Any]) -> None:
    services = config["services"]
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert services["airflow-init"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in AIRFLOW_SERVICES[1:]:
        depends = services[name]["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy", name
        assert depends["fake-gcs"]["condition"] == "service_healthy", name
        assert depends["airflow-init"]["condition"] == "service_completed_successfully", name
    assert services["api-server"]["ports"][0]["target"] == 8080


def test_fake_gcs_service_and_volumes(config: dict[str, Any]) -> None:
    fake_gcs = config["services"]["fake-gcs"]
    assert fake_gcs["image"].startswith("fsouza/fake-gcs-server")
    command = fake_gcs["command"]
    assert command[command.index("-scheme") + 1] == "http"
    assert command[command.index("-port") + 1] == "4443"
    assert config["services"]["trainer"]["environment"]["STORAGE_EMULATOR_HOST"] == "http://fake-gcs:4443"
    auth_mounts = {m["target"]: m for m in config["services"]["api-server"]["volumes"]}
    assert auth_mounts["/opt/airflow/auth"]["source"] == "airflow-auth"
    assert {"postgres-db", "airflow-auth"} <= set(config["volumes"])


# --- airflow-init snippets, run for real ----------------------------------------------------------


def test_init_snippets_create_bucket_and_password_file(
    config: dict[str, Any], gcs_emulator: str, tmp_path: Path
) -> None:
    init = config["services"]["airflow-init"]
    script_lines = [line for line in init["command"][-1].splitlines() if line.strip()]
    assert script_lines[0] == "airflow db migrate"
    python_snippets = [shlex.split(line)[2] for line in script_lines if line.startswith("python -c ")]
    assert len(python_snippets) == 2

    bucket = f"init-{uuid.uuid4().hex[:12]}"
    env = {
        **os.environ,
        **init["environment"],
        "STORAGE_EMULATOR_HOST": gcs_emulator,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(tmp_path / "passwords.json"),
        "SYNCSWITCH_BUCKET_DIR": f"gs://{bucket}/runs",
    }
    for _ in range(2):  # the init container may run again on every `up`: it must be idempotent
        for snippet in python_snippets:
            result = subprocess.run(
                [sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=120
            )
            assert result.returncode == 0, result.stderr

    assert json.loads((tmp_path / "passwords.json").read_text()) == {"admin": "admin"}
    assert storage.gcs_client().lookup_bucket(bucket) is not None


# --- Dockerfiles ----------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a continued instruction"
    return instructions


def _args(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for kw, args in instructions if kw == keyword]


def _dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _is_ignored(rel_path: str, patterns: list[str]) -> bool:
    parts = Path(rel_path).parts
    return any(
        fnmatch.fnmatch(rel_path, pat) or fnmatch.fnmatch(parts[0], pat) or fnmatch.fnmatch(parts[-1], pat)
        for pat in (p.removeprefix("**/") for p in patterns)
    )


@pytest.mark.parametrize("dockerfile", [AIRFLOW_DOCKERFILE, TRAINER_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_copies_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    instructions = dockerfile_instructions(dockerfile)
    assert _args(instructions, "FROM") == ["python:3.11-slim"]
    patterns = _dockerignore_patterns()
    copies = [args.split() for args in _args(instructions, "COPY")]
    assert copies, f"{dockerfile.name} copies nothing"
    for *sources, _dest in copies:
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY source {source} is missing"
            assert not _is_ignored(source.rstrip("/"), patterns), f"{source} is excluded by .dockerignore"
    copied = {source for *sources, _dest in copies for source in sources}
    assert {"pyproject.toml", "uv.lock"} <= copied, "the image must install from the lock"


@pytest.mark.parametrize("dockerfile", [AIRFLOW_DOCKERFILE, TRAINER_DOCKERFILE], ids=lambda p: p.name)
def test_uv_cache_stays_out_of_the_image(dockerfile: Path) -> None:
    """Every `uv sync` keeps its downloads in a build cache mount: without one, the trainer image
    carried 1.8 GB of wheels in its dependency layer (built with buildah, 2026-11-27)."""
    syncs = [args for args in _args(dockerfile_instructions(dockerfile), "RUN") if "uv sync" in args]
    assert syncs, f"{dockerfile.name} runs no uv sync"
    for args in syncs:
        assert args.startswith("--mount=type=cache,target=/root/.cache/uv "), args


def test_dockerignore_excludes_local_state() -> None:
    patterns = _dockerignore_patterns()
    for path in (".venv", "runs", ".airflow", ".git", "training/syncswitch/__pycache__", ".pytest_cache"):
        assert _is_ignored(path, patterns), path
    for path in ("training", "plugins", "dags", "uv.lock", "pyproject.toml", "README.md"):
        assert not _is_ignored(path, patterns), path


def test_airflow_dockerfile(config: dict[str, Any]) -> None:
    instructions = dockerfile_instructions(AIRFLOW_DOCKERFILE)
    runs = " ".join(_args(instructions, "RUN"))
    assert "uv sync --frozen --no-default-groups --group deploy" in runs
    copied = {args.split()[0].rstrip("/") for args in _args(instructions, "COPY")}
    assert {"training", "plugins", "dags"} <= copied
    env = " ".join(_args(instructions, "ENV"))
    assert "AIRFLOW_HOME=/opt/airflow" in env
    compose_env = config["services"]["scheduler"]["environment"]
    # the compose settings point at the installed provider's DAG files and the image's empty plugins
    assert f"AIRFLOW__CORE__DAGS_FOLDER={compose_env['AIRFLOW__CORE__DAGS_FOLDER']}" in env
    assert f"AIRFLOW__CORE__PLUGINS_FOLDER={compose_env['AIRFLOW__CORE__PLUGINS_FOLDER']}" in env
    assert _args(instructions, "EXPOSE") == ["8080"]


def test_trainer_dockerfile() -> None:
    instructions = dockerfile_instructions(TRAINER_DOCKERFILE)
    assert json.loads(_args(instructions, "ENTRYPOINT")[0]) == ["syncswitch", "train"]
    runs = " ".join(_args(instructions, "RUN"))
    assert "uv sync --frozen --no-default-groups --package syncswitch" in runs
    assert "airflow" not in runs.lower()
    copied = {args.split()[0].rstrip("/") for args in _args(instructions, "COPY")}
    # The other members' manifests (uv reads the whole workspace), never their code.
    members = ("training", "plugins", "testing")
    manifests = {"pyproject.toml", *(f"{member}/pyproject.toml" for member in members)}
    assert copied == {*manifests, "training"}


def _imported_top_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def test_training_package_needs_only_the_trainer_runtime() -> None:
    """Every third-party import under training/ is installed in the trainer image."""
    unavailable = {}
    for path in sorted((REPO / "training" / "syncswitch").rglob("*.py")):
        third_party = _imported_top_modules(path) - set(sys.stdlib_module_names) - {"syncswitch"}
        if path.name == "cli.py":
            # `syncswitch run` imports the Airflow side lazily; nodes only run `syncswitch train`.
            third_party -= {"syncswitch_airflow"}
        if missing := third_party - TRAINER_RUNTIME_MODULES:
            unavailable[path.name] = sorted(missing)
    assert unavailable == {}, f"imports the trainer image does not provide: {unavailable}"


def test_train_command_imports_no_airflow() -> None:
    code = (
        "import sys, syncswitch.cli, syncswitch.launcher; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('airflow', 'syncswitch_airflow')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
