#!/usr/bin/env bash
# Set up everything kvcore needs in ./.venv: the core (builds the C++ swap ops), the three
# backends, and the test tools. Safe to re-run; does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Mooncake's wheel needs libibverbs at import time (installed when we may: as root, via apt).
bash plugins/kv_mooncake/scripts/ensure_system_deps.sh || \
  echo "warning: could not install Mooncake's system libraries; its tests will say why" >&2

# xxhash's header: the native file I/O (kvcore.fileio) computes checksums in C++ with it. Without
# it kvcore still builds, and kv_file hashes in Python (slower, same bytes).
if ! echo '#include <xxhash.h>' | "${CXX:-c++}" -E -x c++ - >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing libxxhash-dev (xxhash.h, for kvcore's native file I/O)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libxxhash-dev \
      >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          libxxhash-dev >/dev/null 2>&1; } ||
      echo "warning: could not install libxxhash-dev; kv_file will hash in Python" >&2
  else
    echo "note: xxhash.h not found (apt install libxxhash-dev); kv_file will hash in Python" >&2
  fi
fi

.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade "pip>=23" wheel "setuptools>=77"
# (setuptools' advice about editable installs is noise here: the venv is ours)
PYTHONWARNINGS=ignore .venv/bin/python -m pip install --quiet --disable-pip-version-check \
  -e ".[test,cli,paddle]" \
  -e plugins/kv_file \
  -e plugins/kv_mooncake \
  -e plugins/kv_attentionstore \
  -e plugins/kv_tiered
