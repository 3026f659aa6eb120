#!/usr/bin/env bash
# Install everything, then run every check: ruff (lint + format), the tests of the core and of
# each backend package (the file, Mooncake and AttentionStore plugins), then each engine
# adapter's tests against the engine's real code.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
took() { echo "== $1: $((SECONDS - $2)) s"; }

bash scripts/install.sh
took "install" "$started"

# Engine adapters get their own venvs where the engine's pins conflict with Paddle's (created
# once, reused afterwards). Creating them is mostly download and unpacking: it runs in the
# background while the core's tests run, and its output is shown after them.
setup_log="$(mktemp)"
trap 'rm -f "$setup_log"' EXIT
(
  for script in integrations/*/scripts/test.sh; do
    [ -f "$script" ] || continue
    bash "$script" --setup-only || echo "FAILED to set up: $script"
  done
) >"$setup_log" 2>&1 &
setup_pid=$!

# The release build (issue 27): every package's wheel and sdist, and the wheels their offline
# install test needs, made here where the package index is reachable (tests/test_release.py
# installs from them in a fresh venv without compilers)
phase=$SECONDS
bash scripts/build-wheels.sh .release/dist --wheelhouse .release/wheelhouse >/dev/null
took "release build" "$phase"

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

echo "== pytest"
phase=$SECONDS
set +e
.venv/bin/python -m pytest -p no:cacheprovider -q --durations=10 \
  tests plugins/kv_file/tests plugins/kv_mooncake/tests plugins/kv_attentionstore/tests \
  plugins/kv_tiered/tests "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  code=1
fi
took "core and backends" "$phase"

phase=$SECONDS
wait "$setup_pid" || true
echo "== engine venvs (set up in the background; waited $((SECONDS - phase)) s more)"
cat "$setup_log"

# Each adapter's tests, in its venv (the setup above is a no-op now: its stamps match).
for script in integrations/*/scripts/test.sh; do
  [ -f "$script" ] || continue
  name="$(dirname "$(dirname "$script")")"
  echo "== $name"
  phase=$SECONDS
  if ! bash "$script"; then
    echo "FAILED: $script" >&2
    code=1
  fi
  took "$name" "$phase"
done
took "everything" "$started"
exit "$code"
