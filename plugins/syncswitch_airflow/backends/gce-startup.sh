#!/bin/bash
# Startup script of a sync-switch Compute Engine VM (metadata "startup-script"; runs as root at boot).
#
# Installs the training runtime where the gce backend expects it (metadata "syncswitch-python",
# default /opt/syncswitch/.venv/bin/python): a venv with the runtime's dependencies at the lock's
# versions (metadata "syncswitch-requirements") and the runtime package the backend uploaded for this
# run (metadata "syncswitch-runtime", a gs:// tarball of training/syncswitch).
# The backend waits until `python -c "import syncswitch.forkserver"` works over SSH, so the runtime
# is unpacked last. A custom image that already has the venv skips the install (a faster boot).
# GPU VMs need NVIDIA drivers in the image (e.g. a Deep Learning VM image); TensorFlow's CUDA wheels
# are installed when nvidia-smi is there.
set -euo pipefail
attribute() {
    curl -sf -H "Metadata-Flavor: Google" \
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
PYTHON="$(attribute syncswitch-python)"
RUNTIME="$(attribute syncswitch-runtime)"
VENV="${PYTHON%/bin/python}"

if [ ! -x "$PYTHON" ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -yq python3-venv curl
    python3 -m venv "$VENV"
    # The lock's versions (metadata "syncswitch-requirements": the runtime's requirements.txt); a
    # GPU VM takes the same TensorFlow version with its CUDA libraries instead of the CPU wheel.
    attribute syncswitch-requirements > /tmp/syncswitch-requirements.txt
    if command -v nvidia-smi >/dev/null 2>&1; then
        sed -i 's/^tensorflow-cpu==/tensorflow[and-cuda]==/' /tmp/syncswitch-requirements.txt
    fi
    "$VENV/bin/pip" install -q -r /tmp/syncswitch-requirements.txt
fi

# This run's runtime, unpacked into the venv's site-packages (replacing an image's older one).
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PYTHON" - "$RUNTIME" "$SITE" <<'PY'
import io, shutil, sys, tarfile
from google.cloud import storage
uri, site = sys.argv[1], sys.argv[2]
bucket, _, key = uri.removeprefix("gs://").partition("/")
data = storage.Client().bucket(bucket).blob(key).download_as_bytes()
shutil.rmtree(f"{site}/syncswitch", ignore_errors=True)
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    # Our own tarball; extraction filters came in Python 3.11.4 (Debian 12 has 3.11.2).
    tar.extractall(site, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
PY
"$PYTHON" -c "import syncswitch.forkserver" && echo "sync-switch runtime ready: $PYTHON"
