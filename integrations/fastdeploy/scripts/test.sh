#!/usr/bin/env bash
# Tests of kvcore-fastdeploy. They need Paddle, kvcore and the kv_file / kv_mooncake backends,
# all of which the repository's main venv (./.venv, made by scripts/install.sh) already has, so
# this uses that venv: it creates it if missing, installs this package into it (editable, once;
# again only when pyproject.toml changed), and runs the tests. Mooncake's tests start a real
# mooncake_master on 127.0.0.1. Extra arguments go to pytest; `--setup-only` as the first argument
# installs and stops.
set -euo pipefail
setup_only=0
if [ "${1:-}" = "--setup-only" ]; then
  setup_only=1
  shift
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$here/../.." && pwd)"
py="$root/.venv/bin/python"

if [ ! -x "$py" ] || ! "$py" -c "import paddle, kvcore, kv_file, kv_mooncake" 2>/dev/null; then
  bash "$root/scripts/install.sh"
fi

stamp="$root/.venv/.kvcore-fastdeploy-installed"
if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ] \
  || ! "$py" -c "import kvcore_fastdeploy" 2>/dev/null; then
  # kvcore and the backends are already there (editable): nothing to fetch
  PYTHONWARNINGS=ignore "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$here"
  touch "$stamp"
fi
[ "$setup_only" = 1 ] && exit 0

set +e
"$py" -m pytest -p no:cacheprovider -q "$here/tests" "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  code=1
fi
exit "$code"
