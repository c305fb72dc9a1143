#!/usr/bin/env bash
# A Debian base image made locally with debootstrap, for machines that reach a Debian mirror but no
# container registry. Needs root. Usage (all optional, shown with defaults):
#
#   deploy/image/build-base.sh [--tag localhost/debian:bookworm] [--suite bookworm] [--mirror URL]
#                              [--extra-ca-certs DIR] [--if-missing]
#
# --mirror: the mirror apt already uses here (first URIs/deb line under /etc/apt), else deb.debian.org.
# --extra-ca-certs DIR: *.crt files added to the image's trust store (update-ca-certificates), for networks
#   whose TLS goes through an intercepting proxy; `make image-base` passes /usr/local/share/ca-certificates,
#   the host's own extra certificates (none on most machines).
# --if-missing: do nothing when the tag exists already.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
engine="$here/engine.sh"

tag=localhost/debian:bookworm suite=bookworm mirror="" ca_dir="" if_missing=0
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        --suite) suite="$2"; shift 2 ;;
        --mirror) mirror="$2"; shift 2 ;;
        --extra-ca-certs) ca_dir="$2"; shift 2 ;;
        --if-missing) if_missing=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    esac
done

if [ "$if_missing" = 1 ] && "$engine" image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag exists"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "debootstrap needs root: run as root, or pull a Debian base from a registry (IMAGE_BASE=debian:bookworm-slim)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap: apt-get install debootstrap" >&2; exit 1; }

host_mirror() {
    # deb822 sources first (Debian 12's default), then the one-line format.
    local uri
    uri="$(grep -h -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | awk '{print $2}')"
    [ -n "$uri" ] || uri="$(grep -h -m1 -E '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | head -n1 | awk '{print $2}')"
    echo "${uri:-http://deb.debian.org/debian}"
}
mirror="${mirror:-$(host_mirror)}"
mirror="${mirror%/}"
security="${mirror%/debian}/debian-security"

rootfs="$(mktemp -d /var/tmp/facesearch-base.XXXXXX)"
cleanup() {
    # debootstrap unmounts what it mounted; never follow a leftover mount out of the tree.
    for m in proc sys dev/pts dev; do mountpoint -q "$rootfs/$m" 2>/dev/null && umount -l "$rootfs/$m"; done
    rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

echo "debootstrap $suite from $mirror"
debootstrap --variant=minbase --include=ca-certificates "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"

# debootstrap writes only the main suite; updates and security fixes come from their own suites.
rm -f "$rootfs/etc/apt/sources.list"
cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES

if [ -n "$ca_dir" ]; then
    shopt -s nullglob
    certs=("$ca_dir"/*.crt)
    shopt -u nullglob
    if [ "${#certs[@]}" -gt 0 ]; then
        cp "${certs[@]}" "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
        echo "added ${#certs[@]} CA certificate(s) from $ca_dir"
    fi
fi

chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/* "$rootfs"/tmp/*
tar --numeric-owner -C "$rootfs" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "imported $tag"
