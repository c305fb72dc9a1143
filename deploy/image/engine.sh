#!/usr/bin/env bash
# The container engine with this project's settings: `deploy/image/engine.sh images`, `... run ...`.
#
# ENGINE=podman|docker picks one; otherwise podman when installed, else docker when its daemon answers.
# For podman, CONTAINERS_CONF defaults to deploy/image/containers.conf (nothing under /etc is touched);
# images go to podman's usual store, so plain `podman images` lists them too.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

engine="${ENGINE:-}"
if [ -z "$engine" ]; then
    if command -v podman >/dev/null; then
        engine=podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        engine=docker
    else
        echo "no container engine: install podman (apt-get install podman buildah runc) or start docker" >&2
        exit 1
    fi
fi
if [ "$engine" = podman ]; then
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
fi
if [ "${1:-}" = --which ]; then  # the engine that would run, for scripts
    echo "$engine"
    exit 0
fi
exec "$engine" "$@"
