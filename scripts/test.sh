#!/usr/bin/env bash
# Install everything, then run every check: ruff (lint + format) and the tests of the core
# and of each backend package (the file, Mooncake and AttentionStore plugins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

echo "== pytest"
set +e
.venv/bin/python -m pytest -p no:cacheprovider -q --durations=10 \
  tests plugins/kv_file/tests plugins/kv_mooncake/tests plugins/kv_attentionstore/tests "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  code=1
fi

# Engine adapters: each integration runs its own tests against the engine's real code, in its
# own venv where the engine's pins conflict with Paddle's (created once, reused afterwards).
for script in integrations/*/scripts/test.sh; do
  [ -f "$script" ] || continue
  echo "== $(dirname "$(dirname "$script")")"
  if ! bash "$script"; then
    echo "FAILED: $script" >&2
    code=1
  fi
done
exit "$code"
