#!/usr/bin/env bash
# Install everything, then run the main job: `kvcore demo` on the embedded file backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kvcore demo "$@"
