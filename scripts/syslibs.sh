#!/usr/bin/env bash
# Makes the system libraries Mooncake's wheel links (libibverbs.so.1 and its libnl dependencies) available
# without installing anything system-wide: if the loader already finds libibverbs.so.1, nothing is done;
# otherwise the Debian packages are downloaded (`apt-get download`, no root needed) and unpacked (`dpkg -x`)
# into DEST, where kvtier finds them (kvtier/tiers/_mooncake_env.py).   Usage: scripts/syslibs.sh DEST
set -euo pipefail
dest=${1:?usage: scripts/syslibs.sh DEST}
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    echo "kvtier: libibverbs.so.1 is installed system-wide; nothing to unpack"
    exit 0
fi
if [ -e "$dest/usr/lib/x86_64-linux-gnu/libibverbs.so.1" ] || [ -e "$dest/usr/lib/aarch64-linux-gnu/libibverbs.so.1" ]; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pkgs="libibverbs1 libnl-3-200 libnl-route-3-200"
if ! (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1); then
    if [ "$(id -u)" = 0 ]; then  # package lists missing on a fresh machine: refresh them (root only) and retry
        apt-get update -qq >/dev/null 2>&1 || true
    fi
    (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1) || {
        echo "kvtier: could not download $pkgs (apt-get download); install libibverbs1 system-wide instead" >&2
        exit 1
    }
fi
mkdir -p "$dest"
for d in "$tmp"/*.deb; do dpkg -x "$d" "$dest"; done
echo "kvtier: unpacked $pkgs into $dest (no root needed; Mooncake loads them from there)"
