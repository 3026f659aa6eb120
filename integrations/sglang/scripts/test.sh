#!/usr/bin/env bash
# Test kvcore-sglang against SGLang's real storage layer, on CPU.
#
# Creates integrations/sglang/.venv once (CPU torch, the sglang wheel without its CUDA
# dependencies, the packages its storage layer imports, and kvcore, kv_file, kv_mooncake and
# this package editable) and reuses it while requirements-test.txt and the packages' metadata
# are unchanged. Then runs the tests; extra arguments go to pytest. Exits non-zero on failure.
# `--setup-only` as the first argument installs and stops.
set -euo pipefail
setup_only=0
if [ "${1:-}" = "--setup-only" ]; then
  setup_only=1
  shift
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$here"

SGLANG_VERSION=0.5.23
PY=${PYTHON:-python3}
venv="$here/.venv"
stamp="$venv/.kvcore-sglang-installed"
want="$(cat requirements-test.txt pyproject.toml "$repo/pyproject.toml" "$repo/setup.py" \
  "$repo/plugins/kv_file/pyproject.toml" "$repo/plugins/kv_mooncake/pyproject.toml" \
  | sha256sum | cut -d' ' -f1)-$SGLANG_VERSION"

if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "== kvcore-sglang: installing the test venv ($venv)"
  # Mooncake's wheel needs libibverbs at import time (installed when we may: as root, via apt)
  bash "$repo/plugins/kv_mooncake/scripts/ensure_system_deps.sh" ||
    echo "warning: could not install Mooncake's system libraries; its tests will fail" >&2
  log="$venv/install.log"
  : >"$log"
  pip() {
    # pip's resolver lists sglang's declared (CUDA) requirements as conflicts on every later
    # install: expected here, so the output goes to a log shown only when a step fails
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "kvcore-sglang: pip install $* failed (log: $log)" >&2
      exit 1
    fi
  }
  pip --upgrade "pip>=23" wheel "setuptools>=77"
  pip -r requirements-test.txt -c requirements-test.txt
  pip --no-deps "sglang==$SGLANG_VERSION"
  PYTHONWARNINGS=ignore pip -c requirements-test.txt \
    -e "$repo" -e "$repo/plugins/kv_file" -e "$repo/plugins/kv_mooncake" -e "$here"
  echo "$want" >"$stamp"
fi

[ "$setup_only" = 1 ] && exit 0

echo "== kvcore-sglang: pytest (SGLang $SGLANG_VERSION's real classes)"
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider -q --durations=10 tests "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$code"
