#!/usr/bin/env bash
# Make sure the shared libraries the Mooncake wheel links against are present.
# The non-CUDA wheel needs libibverbs.so.1 even when only TCP is used; libnuma1 and libcurl4
# are normally already installed. Idempotent: does nothing when the libraries resolve.
set -euo pipefail

missing=()
for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1; do
    soname=${lib%%:*}
    package=${lib##*:}
    if ! ldconfig -p 2>/dev/null | grep -q "${soname}"; then
        missing+=("${package}")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "ensure_system_deps: mooncake system libraries present"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "ensure_system_deps: missing ${missing[*]}; run as root or: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_system_deps: missing ${missing[*]} and apt-get is not available; install them with your package manager" >&2
    exit 1
fi

echo "ensure_system_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
