#!/bin/bash
# Startup script of a sync-switch Compute Engine VM (metadata "startup-script"; runs as root at boot).
#
# Installs the training runtime where the gce backend expects it (metadata "syncswitch-python",
# default /opt/syncswitch/.venv/bin/python) with the same installer as the hosts backend's
# (metadata "syncswitch-install": node_install.py, standard library only): a venv with the runtime's
# dependencies at the lock's versions (metadata "syncswitch-requirements"), TensorFlow's CUDA build
# and its CUDA libraries on a GPU VM (pinned there too), the user code's own requirements where it
# lists some (metadata "syncswitch-user-requirements", resolved by the backend), and the runtime's
# wheel the backend uploaded for this run (metadata "syncswitch-runtime", a gs:// URI, fetched with
# the VM's service account).
# An image made with the same installer keeps its dependencies and gets only this run's runtime (a
# faster boot).
# The backend waits until `python -c "import syncswitch.forkserver"` works over SSH.
set -euo pipefail
attribute() {
    curl -sf -H "Metadata-Flavor: Google" \
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
PYTHON="$(attribute syncswitch-python)"
STAGE="$(mktemp -d /tmp/syncswitch-install.XXXXXX)"
attribute syncswitch-install > "$STAGE/node_install.py"
attribute syncswitch-requirements > "$STAGE/requirements.txt"
USER_REQUIREMENTS=()  # none unless the job's user code lists some
if attribute syncswitch-user-requirements > "$STAGE/user-requirements.txt"; then
    USER_REQUIREMENTS=(--user-requirements "$STAGE/user-requirements.txt")
fi

# Debian's python3 makes venvs only with its python3-venv package (uv, where an image has it, needs none).
if ! command -v uv >/dev/null 2>&1 && ! python3 -c "import ensurepip" 2>/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -yq python3-venv
fi
# The lock's wheels are for one Python (node_install.PYTHON_VERSION). On an image with another python3
# (a Deep Learning VM image's 3.10) only uv can make that venv: it brings the Python. It comes from
# the package index the pins come from, at the version the Airflow side runs (metadata "syncswitch-uv").
LOCK_PYTHON="$(cd "$STAGE" && python3 -c 'import node_install; print(node_install.PYTHON_VERSION)')"
THIS_PYTHON="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if ! command -v uv >/dev/null 2>&1 && [ "$THIS_PYTHON" != "$LOCK_PYTHON" ]; then
    python3 -m venv /opt/syncswitch/uv
    /opt/syncswitch/uv/bin/python -m pip install --quiet --disable-pip-version-check \
        "$(attribute syncswitch-uv)"
    PATH="/opt/syncswitch/uv/bin:$PATH"
fi
python3 "$STAGE/node_install.py" "${PYTHON%/bin/python*}" \
    --requirements "$STAGE/requirements.txt" --runtime "$(attribute syncswitch-runtime)" \
    "${USER_REQUIREMENTS[@]}"
echo "sync-switch runtime ready: $PYTHON"
