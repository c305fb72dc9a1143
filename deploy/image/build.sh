#!/usr/bin/env bash
# Build the service image: deploy/image/build.sh [--variant cpu|gpu] [--base IMAGE] [--tag TAG]
#
# --variant cpu: onnxruntime (CPU only); gpu: onnxruntime-gpu (CUDA 13 + cuDNN 9, see the Dockerfile).
# --base: the FROM image. Default for gpu: the Dockerfile's CUDA base (from a registry); for cpu:
#   localhost/debian:bookworm, made here with debootstrap first when it is missing (deploy/image/build-base.sh;
#   needs root), so no registry is needed.
# --tag: default localhost/facesearch:<variant>.
# Extra arguments after -- go to the engine's build command. Podman builds use the host network
# (`--network host`): its default build network needs setup that not every machine has.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
engine="$here/engine.sh"
local_base=localhost/debian:bookworm

variant=cpu base="" tag=""
while [ $# -gt 0 ]; do
    case "$1" in
        --variant) variant="$2"; shift 2 ;;
        --base) base="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    esac
done
case "$variant" in cpu|gpu) ;; *) echo "--variant is cpu or gpu, not $variant" >&2; exit 2 ;; esac
if [ -z "$base" ] && [ "$variant" = cpu ]; then
    base="$local_base"
fi
tag="${tag:-localhost/facesearch:$variant}"

if [ "$base" = "$local_base" ]; then
    "$here/build-base.sh" --if-missing --tag "$local_base" --extra-ca-certs "${IMAGE_BASE_CA_CERTS:-}"
fi

args=(build -t "$tag" --build-arg "VARIANT=$variant" -f "$repo/Dockerfile")
[ -n "$base" ] && args+=(--build-arg "BASE_IMAGE=$base")
[ "$("$engine" --which)" = podman ] && args+=(--network host)
echo "building $tag (variant $variant, base ${base:-the Dockerfile default})"
start=$(date +%s)
"$engine" "${args[@]}" "$@" "$repo"
echo "built $tag in $(($(date +%s) - start)) s"
"$engine" image inspect --format '{{.Size}}' "$tag" | awk -v t="$tag" '{printf "%s: %.0f MB\n", t, $1 / 1e6}'
