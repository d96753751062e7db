"""A container deployment's one-time set-up (docker-compose.yaml's ``airflow-init`` service):

    python -m syncswitch_airflow.deploy_init

1. the secrets, each made only where missing, in ``$SYNCSWITCH_SECRETS_DIR`` (a volume every service
   mounts): the Fernet key, the JWT and API secrets (read through Airflow's ``*_CMD`` settings), the
   admin password (``$AIRFLOW_ADMIN_PASSWORD`` where set, else random) in the simple auth manager's
   passwords file, and the training hosts' SSH keys (the client key the ``hosts`` backend logs in
   with, the host key every trainer presents, and its public half that runs pin);
2. ``airflow db migrate``;
3. the runs bucket of ``[syncswitch] bucket_dir``, where it is a ``gs://`` folder.

Nothing secret is committed or baked into an image: a new deployment gets its own, kept as long as its
volume (``docker compose down -v`` deletes them with the rest).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from syncswitch import storage

SECRETS_DIR_ENV = "SYNCSWITCH_SECRETS_DIR"
DEFAULT_SECRETS_DIR = "/opt/airflow/secrets"
SERVICE_UID = 50000  # the images' airflow user, which reads the secrets
ADMIN_USER = "admin"


def log(message: str) -> None:
    print(f"deploy-init: {message}", flush=True)


def make_secrets(folder: Path, admin_password: str = "") -> None:
    """Every secret of the deployment in ``folder``, each made only where missing."""
    ssh = folder / "ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    _once(folder / "fernet_key", lambda: base64.urlsafe_b64encode(os.urandom(32)).decode())
    _once(folder / "jwt_secret", lambda: secrets.token_urlsafe(48))
    _once(folder / "api_secret_key", lambda: secrets.token_urlsafe(48))
    password = _once(folder / "admin_password", lambda: admin_password or secrets.token_urlsafe(12))
    # The simple auth manager opens it for appending (the api-server's own, read-write).
    _once(folder / "passwords.json", lambda: json.dumps({ADMIN_USER: password}), mode=0o600)
    client = _key_pair(ssh / "id_ed25519", "syncswitch-airflow")
    _once(ssh / "authorized_keys", lambda: client + "\n", owner=0, mode=0o644)
    host = _key_pair(ssh / "host_ed25519_key", "syncswitch-trainer", owner=0)
    _once(ssh / "host_ed25519_key.pub", lambda: host + "\n", mode=0o444)


def _once(path: Path, make: Callable[[], str], owner: int = SERVICE_UID, mode: int = 0o400) -> str:
    """The file's text, written by ``make`` first where it does not exist (readable by ``owner``)."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(make())
        _own(tmp, owner, mode)
        tmp.replace(path)
        log(f"made {path}")
    return path.read_text().strip()


def _own(path: Path, owner: int, mode: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, owner, 0)
    path.chmod(mode)


def _key_pair(path: Path, comment: str, owner: int = SERVICE_UID) -> str:
    """An Ed25519 key in OpenSSH's format at ``path`` (made where missing); its public line."""

    def private() -> str:
        key = Ed25519PrivateKey.generate()
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ).decode()

    text = _once(path, private, owner=owner, mode=0o400)
    key = serialization.load_ssh_private_key(text.encode(), password=None)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return f"{public.decode()} {comment}"


def migrate() -> None:
    log("airflow db migrate")
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], check=True)


def make_bucket(bucket_dir: str) -> None:
    if not bucket_dir.startswith(storage.GS_PREFIX):
        return
    name = storage.split_gs(bucket_dir)[0]
    client = storage.gcs_client()
    if client.lookup_bucket(name) is None:
        client.create_bucket(name)
        log(f"made the bucket {name}")


def main() -> int:
    folder = Path(os.environ.get(SECRETS_DIR_ENV, DEFAULT_SECRETS_DIR))
    make_secrets(folder, os.environ.get("AIRFLOW_ADMIN_PASSWORD", ""))
    migrate()
    from syncswitch_airflow import settings

    make_bucket(settings.get("bucket_dir") or "")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
