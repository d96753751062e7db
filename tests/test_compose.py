"""Deployment files, validated without a Docker engine (the stack itself runs in test_compose_stack).

docker-compose.yaml goes through the real compose v2 binary (``config`` checks schema, types and
references without a daemon); the Dockerfiles are parsed and checked against the repository, the
compose file, .dockerignore and the stand-in bases; airflow-init's set-up runs against the GCS
emulator.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
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
    "packaging",  # syncswitch.requirements reads a user's requirements.txt
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


def test_expected_services_exist_and_each_has_an_init(config: dict[str, Any]) -> None:
    assert set(config["services"]) == {"postgres", "redis", "fake-gcs", "trainer", *AIRFLOW_SERVICES}
    result = run_compose(COMPOSE_FILE, "config", "--services")  # all of them start with a plain `up`
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == set(config["services"])
    # An init process reaps what a service's main process leaves (Airflow's children, sshd's sessions).
    assert {name: s.get("init") for name, s in config["services"].items()} == dict.fromkeys(
        config["services"], True
    )


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
        # Each is read from the deployment's secrets volume, never written in the file.
        for key in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
            assert key not in env, f"{name}: {key} is written in the compose file"
        secrets.add(
            (
                env["AIRFLOW__CORE__FERNET_KEY_CMD"],
                env["AIRFLOW__API_AUTH__JWT_SECRET_CMD"],
                env["AIRFLOW__API__SECRET_KEY_CMD"],
            )
        )
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://"), name
        assert "@postgres:5432/" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], name
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "false", name
        assert int(env["AIRFLOW__CORE__PARALLELISM"]) >= 1, name
        assert env["STORAGE_EMULATOR_HOST"] == "http://fake-gcs:4443", name
        assert env["AIRFLOW__SYNCSWITCH__DEFAULT_PARAMS"] == "/opt/airflow/config/default-params.yaml", name
        mounts = {m["target"]: m for m in service["volumes"]}
        assert mounts["/opt/airflow/secrets"]["source"] == "secrets", name
    assert len(secrets) == 1
    assert all(command.startswith("cat /opt/airflow/secrets/") for command in secrets.pop())
    commands = {name: config["services"][name]["command"][:3] for name in AIRFLOW_SERVICES[1:]}
    assert commands == {
        "api-server": ["airflow", "api-server", "--port"],
        "scheduler": ["airflow", "scheduler"],
        "dag-processor": ["airflow", "dag-processor"],
        "triggerer": ["airflow", "triggerer"],
        "airflow-worker": ["airflow", "celery", "worker"],
    }


def test_workers_share_no_writable_disk(config: dict[str, Any]) -> None:
    """Two workers, each writing only to its container's own filesystem: what every service mounts
    (the secrets, ./jobs, ./usr, ./config) is read-only for it; the bucket is how they share."""
    services = config["services"]
    assert services["airflow-worker"]["deploy"]["replicas"] >= 2
    for name in (*AIRFLOW_SERVICES[1:], "trainer"):
        writable = [m["target"] for m in services[name].get("volumes", []) if not m.get("read_only")]
        # The simple auth manager opens its passwords file (in the secrets) for appending.
        allowed = ["/opt/airflow/secrets"] if name == "api-server" else []
        assert writable == allowed, f"{name} writes to a shared mount: {writable}"
    mounts = {m["target"]: m["source"] for m in services["airflow-worker"]["volumes"]}
    for folder in ("jobs", "usr", "config"):
        assert Path(mounts[f"/opt/airflow/{folder}"]) == REPO / folder, folder


def test_dependencies_wait_for_health_and_init(config: dict[str, Any]) -> None:
    services = config["services"]
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert services["airflow-init"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["trainer"]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
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
    # Named volumes only: `docker compose down -v` leaves nothing of a deployment behind.
    assert {"postgres-db", "gcs-data", "secrets"} == set(config["volumes"])
    for name, service in config["services"].items():
        for mount in service.get("volumes", []):
            assert mount["type"] == "volume" or mount.get("read_only"), f"{name} binds {mount['source']}"


def test_the_default_params_are_a_valid_job_on_the_trainers(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from syncswitch_airflow.dag_params import deployment_defaults

    bucket_dir = config["services"]["scheduler"]["environment"]["AIRFLOW__SYNCSWITCH__BUCKET_DIR"]
    monkeypatch.setenv("AIRFLOW__SYNCSWITCH__BUCKET_DIR", bucket_dir)
    # The older name wins over Airflow's; the session's embedded Airflow sets it in this process.
    monkeypatch.delenv("SYNCSWITCH_BUCKET_DIR", raising=False)

    params = deployment_defaults(str(REPO / "config" / "default-params.yaml"))
    assert params["cluster_backend"] == "hosts"
    from syncswitch.spec import JobSpec

    [trainers] = JobSpec.from_params({"bucket_dir": bucket_dir, **params}).hosts
    assert (trainers.address, trainers.each_address, trainers.user) == ("trainer", True, "trainer")
    assert trainers.key == "/opt/airflow/secrets/ssh/id_ed25519"


def test_every_image_the_stack_names_has_a_stand_in() -> None:
    """images/stand-ins/build.sh builds each base under its official tag where no registry is
    reachable: every image the compose file pulls and every FROM of our Dockerfiles."""
    script = (REPO / "images" / "stand-ins" / "build.sh").read_text()
    built = set(re.findall(r"(?:stand_in|! have) (\S+:\S+)", script))
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"].values()
    pulled = {service["image"] for service in services if "build" not in service}
    dockerfiles = (AIRFLOW_DOCKERFILE, TRAINER_DOCKERFILE)
    bases = {args for path in dockerfiles for args in _args(dockerfile_instructions(path), "FROM")}
    assert pulled | bases <= built, sorted((pulled | bases) - built)


# --- airflow-init's set-up, run for real -------------------------------------------------------------


def test_the_deployments_secrets_are_made_once_each_and_the_keys_work(tmp_path: Path) -> None:
    import paramiko
    from syncswitch.hosts import check_host_key
    from syncswitch_airflow.deploy_init import make_secrets

    make_secrets(tmp_path, admin_password="")
    first = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    make_secrets(tmp_path, admin_password="another")  # again on every `up`: nothing changes
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == first
    from cryptography.fernet import Fernet

    Fernet((tmp_path / "fernet_key").read_text())  # a valid key
    password = (tmp_path / "admin_password").read_text()
    assert len(password) >= 12
    assert json.loads((tmp_path / "passwords.json").read_text()) == {"admin": password}
    assert (tmp_path / "jwt_secret").read_text() != (tmp_path / "api_secret_key").read_text()
    client = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "ssh" / "id_ed25519"))
    authorized = (tmp_path / "ssh" / "authorized_keys").read_text().split()
    assert authorized[:2] == [client.get_name(), client.get_base64()]
    host = (tmp_path / "ssh" / "host_ed25519_key.pub").read_text().split()
    check_host_key(" ".join(host[:2]), "host")
    assert oct((tmp_path / "ssh" / "id_ed25519").stat().st_mode & 0o777) == "0o400"


def test_init_makes_the_runs_bucket_once(gcs_emulator: str) -> None:
    from syncswitch_airflow.deploy_init import make_bucket

    bucket = f"init-{uuid.uuid4().hex[:12]}"
    for _ in range(2):  # the init container runs again on every `up`
        make_bucket(f"gs://{bucket}/runs")
    assert storage.gcs_client().lookup_bucket(bucket) is not None
    make_bucket("/a/local/folder")  # not a bucket: nothing to make


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
    assert _args(instructions, "FROM") == ["python:3.11-slim-bookworm"]
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
    """Every `uv sync` keeps its downloads in a build cache mount (else the wheels stay in the layer)."""
    syncs = [args for args in _args(dockerfile_instructions(dockerfile), "RUN") if "uv sync" in args]
    assert syncs, f"{dockerfile.name} runs no uv sync"
    for args in syncs:
        assert "--mount=type=cache,target=/root/.cache/uv" in args.split(" if ")[0].split(), args


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
    # The image points Airflow at the installed provider's DAG files and an empty plugins folder.
    assert "AIRFLOW__CORE__DAGS_FOLDER=/opt/syncswitch/.venv/lib/python3.11/site-packages/" in env
    assert "AIRFLOW__CORE__PLUGINS_FOLDER=/opt/airflow/plugins" in env
    assert _args(instructions, "EXPOSE") == ["8080"]


def test_trainer_dockerfile() -> None:
    instructions = dockerfile_instructions(TRAINER_DOCKERFILE)
    assert json.loads(_args(instructions, "ENTRYPOINT")[0]) == ["trainer-sshd"]
    runs = " ".join(_args(instructions, "RUN"))
    assert "uv sync --frozen --no-default-groups --package syncswitch" in runs
    assert "airflow" not in runs.lower()
    copied = {args.split()[0].rstrip("/") for args in _args(instructions, "COPY")}
    # The other members' manifests (uv reads the whole workspace), never their code.
    members = ("training", "plugins", "testing")
    manifests = {"pyproject.toml", *(f"{member}/pyproject.toml" for member in members)}
    assert copied == {*manifests, "training", "images/trainer-sshd.sh"}


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
