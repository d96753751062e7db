#!/usr/bin/env bash
# The README's second command: install everything from the lock, lint, run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k cli -x.
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
uv run --frozen ruff check .
# -p no:cacheprovider: no .pytest_cache in the checkout; --durations: where the minutes go.
exec uv run --frozen pytest -q -p no:cacheprovider --durations=15 "$@"
