# Sourced by demo.sh and test.sh: make sure the pinned uv is on PATH, then sync the locked environment.
UV_VERSION=0.13.9
if ! command -v uv >/dev/null 2>&1; then
    echo "installing uv ${UV_VERSION} (pip --user)" >&2
    python3 -m pip install --user --quiet "uv==${UV_VERSION}"
    PATH="$(python3 -m site --user-base)/bin:${PATH}"
    export PATH
fi
uv sync --frozen
