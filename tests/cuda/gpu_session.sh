#!/usr/bin/env bash
# One GPU session on a lent machine (the `device` tool): carried wheels, build, checks, bench.
# Usage there:  bash tests/cuda/gpu_session.sh   (writes JSON and logs under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/kvcore-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/plugins/kv_file${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv | tee "$OUT/gpu.txt"
# the C++ extension and the CUDA library, in place (no pip: the machine has no registry)
ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
g++ -O3 -std=c++17 -shared -fPIC -pthread $(python3 -c "import sysconfig; print('-I'+sysconfig.get_paths()['include'])") \
  -Icsrc csrc/_swap_module.cc csrc/swap_ops.cc -o "kvcore/_swap$ext" || exit 1
python3 -c "import sys; sys.path.insert(0, 'csrc'); import cuda_build, subprocess; \
subprocess.check_call(cuda_build.nvcc_command(cuda_build.find_nvcc(), 'kvcore/_swap_cuda.so'), cwd=cuda_build.CSRC)" || exit 1
python3 -c "import kvcore, kvcore.ops as o; print('kvcore imports; cuda_available =', o.cuda_available())"
set -x
timeout 240 python3 tests/cuda/run_cuda_ops.py --lib kvcore/_swap_cuda.so --json "$@" 2>&1 | tee "$OUT/cuda_ops.json"
timeout 300 python3 tests/cuda/run_transfer_gpu.py --bench 2>&1 | tee "$OUT/transfer.json"
