#!/usr/bin/env bash
# The rules CI enforces beyond ruff (docs/architecture.md, "Rules CI enforces"); each fails the
# run on a violation and says where:
#   1. the layering: import-linter's contracts in .importlinter (the core imports no plugin or
#      adapter; plugins and adapters use kvcore's SDK, not the transfer manager's internals);
#   2. the public surface: no plugin, adapter or benchmark imports a private name of another
#      package (ruff's import-private-name, PLC2701);
#   3. the types: mypy on the core and the backend plugins ([tool.mypy] in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin

echo "== rules: layers (import-linter)"
# this checkout's sources, whatever the venv's editable installs point at; the adapters are not
# installed in this venv at all (each has its own)
plugins="plugins/kv_file:plugins/kv_mooncake:plugins/kv_attentionstore:plugins/kv_tiered"
adapters="integrations/vllm:integrations/sglang:integrations/fastdeploy:integrations/lmcache"
PYTHONPATH="$plugins:$adapters" "$py/lint-imports" --no-cache

echo "== rules: no private names across packages (ruff PLC2701)"
"$py/ruff" check --preview --select PLC2701 --output-format concise \
  plugins/*/kv_* integrations/*/kvcore_* benchmarks

echo "== rules: types (mypy)"
"$py/mypy"
