#!/usr/bin/env bash
# The README's first command: install everything from the lock, then run the main job
# (`syncswitch run`: an embedded Airflow triggers the sync_switch DAG with the default params).
# Extra arguments go to `syncswitch run`, e.g. scripts/demo.sh --keep-ui --switch-order 101.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

UV_VERSION=0.13.9
if ! command -v uv >/dev/null 2>&1; then
    echo "installing uv ${UV_VERSION} (pip --user)" >&2
    python3 -m pip install --user --quiet "uv==${UV_VERSION}"
    user_bin="$(python3 -m site --user-base)/bin"
    export PATH="${user_bin}:${PATH}"
fi

uv sync --frozen
exec uv run --frozen syncswitch run "$@"
