# Sourced by demo.sh and test.sh: make sure the pinned uv is on PATH, then sync the locked environment.
UV_VERSION=0.13.9
USER_BIN="$(python3 -m site --user-base)/bin"
if ! command -v uv >/dev/null 2>&1 && [ -x "${USER_BIN}/uv" ]; then
    PATH="${USER_BIN}:${PATH}"  # installed by an earlier run, not on this shell's PATH
    export PATH
fi
if ! command -v uv >/dev/null 2>&1; then
    echo "installing uv ${UV_VERSION} (pip --user)" >&2
    # Debian's python3 is "externally managed" (PEP 668): a --user install of one standalone tool
    # is what that flag is for, and touches no system package.
    python3 -m pip install --user --quiet "uv==${UV_VERSION}" 2>/dev/null \
        || python3 -m pip install --user --quiet --break-system-packages "uv==${UV_VERSION}"
    PATH="${USER_BIN}:${PATH}"
    export PATH
fi
# Bytecode compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on the test machine, and
# likely CI), nothing else ever writes it, and every process compiled what it imported, every time
# (an Airflow task process ~8 s of its start, airflow.sdk's import 8.1 s against 4.7 s compiled).
# Already compiled files are skipped, so a second sync costs little.
uv sync --frozen --compile-bytecode
