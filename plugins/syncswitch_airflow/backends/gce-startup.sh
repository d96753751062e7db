#!/bin/bash
# Startup script of a sync-switch Compute Engine VM (metadata "startup-script"; runs as root at boot).
#
# Installs the training runtime where the gce backend expects it (metadata "syncswitch-python",
# default /opt/syncswitch/.venv/bin/python) with the same installer as the hosts backend's
# (metadata "syncswitch-install": node_install.py, standard library only): a venv with the runtime's
# dependencies at the lock's versions (metadata "syncswitch-requirements"), TensorFlow's CUDA build
# and its CUDA libraries on a GPU VM (pinned there too), and the runtime's wheel the backend uploaded
# for this run (metadata "syncswitch-runtime", a gs:// URI, fetched with the VM's service account).
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

# Debian's python3 makes venvs only with its python3-venv package (uv, where an image has it, needs none).
if ! command -v uv >/dev/null 2>&1 && ! python3 -c "import ensurepip" 2>/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -yq python3-venv
fi
python3 "$STAGE/node_install.py" "${PYTHON%/bin/python*}" \
    --requirements "$STAGE/requirements.txt" --runtime "$(attribute syncswitch-runtime)"
echo "sync-switch runtime ready: $PYTHON"
