#!/usr/bin/env bash
# Test kvcore-lmcache against LMCache's real code, on CPU: mypy, this package's tests (a real
# `lmcache server` and a real `mooncake_master` on 127.0.0.1 among them) and LMCache's own
# tests of its extension points with kvcore in place of LMCache's mocks
# (kvcore_lmcache.testing).
#
# Creates integrations/lmcache/.venv once (CPU torch first, then lmcache and what it pins, then
# kvcore, kv_file, kv_tiered, kv_mooncake and this package editable) and reuses it while
# requirements-test.txt and the packages' metadata are unchanged. LMCache's tests ship in its sdist only: the pinned sdist is
# fetched from PyPI (checked against its sha256) and the suites run here kept in the venv. Extra
# arguments go to pytest (this package's tests). `--setup-only` as the first argument installs
# and stops.
set -euo pipefail
setup_only=0
if [ "${1:-}" = "--setup-only" ]; then
  setup_only=1
  shift
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$here"

LMCACHE_VERSION=0.5.6
LMCACHE_SDIST_URL="https://files.pythonhosted.org/packages/84/25/3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/lmcache-0.5.6.tar.gz"
LMCACHE_SDIST_SHA256=d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e
PY=${PYTHON:-python3}
venv="$here/.venv"
stamp="$venv/.kvcore-lmcache-installed"
upstream="$venv/upstream/lmcache-$LMCACHE_VERSION"
want="$(cat requirements-test.txt pyproject.toml "$repo/pyproject.toml" "$repo/setup.py" \
  "$repo/plugins/kv_file/pyproject.toml" "$repo/plugins/kv_tiered/pyproject.toml" \
  "$repo/plugins/kv_mooncake/pyproject.toml" | sha256sum | cut -d' ' -f1)-$LMCACHE_VERSION"

if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "== kvcore-lmcache: installing the test venv ($venv)"
  # Mooncake's wheel needs libibverbs at import time (installed when we may: as root, via apt)
  bash "$repo/plugins/kv_mooncake/scripts/ensure_system_deps.sh" ||
    echo "warning: could not install Mooncake's system libraries; its tests will fail" >&2
  log="$venv/install.log"
  : >"$log"
  pip() {
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "kvcore-lmcache: pip install $* failed (log: $log)" >&2
      exit 1
    fi
  }
  pip --upgrade "pip>=23" wheel "setuptools>=77"
  torch_pin="$(grep '^torch==' requirements-test.txt)"
  pip "$torch_pin" --extra-index-url https://download.pytorch.org/whl/cpu
  pip -c requirements-test.txt "lmcache==$LMCACHE_VERSION" pytest mypy==2.4.1
  PYTHONWARNINGS=ignore pip -c requirements-test.txt \
    -e "$repo" -e "$repo/plugins/kv_file" -e "$repo/plugins/kv_tiered" \
    -e "$repo/plugins/kv_mooncake" -e "$here"
  # LMCache's own tests, from its sdist (its wheel does not ship them)
  rm -rf "$venv/upstream"
  mkdir -p "$venv/upstream"
  sdist="$venv/upstream/lmcache-$LMCACHE_VERSION.tar.gz"
  "$venv/bin/python" - "$LMCACHE_SDIST_URL" "$sdist" "$LMCACHE_SDIST_SHA256" <<'PYEOF'
import hashlib, sys, urllib.request
url, path, want = sys.argv[1:]
data = urllib.request.urlopen(url, timeout=300).read()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"kvcore-lmcache: {url}: sha256 {got}, expected {want}")
open(path, "wb").write(data)
PYEOF
  # only the suites run below and what they import (not the rest of LMCache's tests)
  top="lmcache-$LMCACHE_VERSION/tests"
  tar -xzf "$sdist" -C "$venv/upstream" "$top/__init__.py" "$top/conftest.py" \
    "$top/v1/__init__.py" "$top/v1/utils.py" "$top/v1/distributed/__init__.py" \
    "$top/v1/distributed/conftest.py" "$top/v1/distributed/utils.py" \
    "$top/v1/distributed/test_mock_l2_adapter.py" "$top/v1/distributed/test_l2_adapter_factory.py" \
    "$top/v1/distributed/test_distributed_storage_manager.py" \
    "$top/v1/storage_backend/__init__.py" "$top/v1/storage_backend/test_storage_plugin.py"
  rm -f "$sdist"
  echo "$want" >"$stamp"
fi

[ "$setup_only" = 1 ] && exit 0

code=0
echo "== kvcore-lmcache: mypy (strict, against LMCache's installed code)"
"$venv/bin/python" -m mypy || code=$?

echo "== kvcore-lmcache: pytest (LMCache $LMCACHE_VERSION's real classes and server)"
"$venv/bin/python" -m pytest -p no:cacheprovider -q --durations=5 tests "$@" || code=$?

# LMCache's tests of the L2 contract (its mock's suite, the adapter factory and plugin loader,
# the distributed storage manager) with the kvcore adapter in the mock's place; run from the
# sdist's root so its `tests` package imports as it does upstream
echo "== kvcore-lmcache: LMCache's own L2 tests, on the kvcore adapter"
(cd "$upstream" && "$venv/bin/python" -m pytest -p no:cacheprovider -q -p kvcore_lmcache.testing \
  tests/v1/distributed/test_mock_l2_adapter.py \
  tests/v1/distributed/test_l2_adapter_factory.py \
  tests/v1/distributed/test_distributed_storage_manager.py \
  tests/v1/storage_backend/test_storage_plugin.py) || code=$?
exit "$code"
