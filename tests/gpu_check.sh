#!/usr/bin/env bash
# The cuda backend on a GPU machine as the project is lent one: no network, a working tree of
# at most 64 MiB (no real models: tiny ones are written on the spot), Python 3.12 with numpy
# and cupy-cuda13x already there. Prepare on a machine with network: `make gpu-bundle`
# (.gpu-bundle/: hearthlm's wheel and the wheels that machine lacks), carry .gpu-bundle along,
# then there:  bash tests/gpu_check.sh          (PYTHON=... picks the interpreter)
# Every step runs under its own time limit (under 8 minutes in all), whatever failed before
# it, and the summary at the end lists each. Without a GPU the steps that need one say
# 'skipped: no GPU' and the others run.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-/tmp/hearthlm-gpu-check}
SITE=$WORK/site  # the bundle goes here (--target), so nothing of the machine's is replaced
export PY WORK SITE PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$WORK"
PASSED=() FAILED=() SKIPPED=()
# no -x: every failure shows. The machine's pytest has no pytest-asyncio, whose ini keys it warns of
PYTEST="-q -rs -p no:cacheprovider -W ignore::pytest.PytestConfigWarning"

step() {  # step NAME SECONDS any|gpu CMD...
  local name=$1 limit=$2 needs=$3 why=""; shift 3
  echo; echo "=== $name (limit ${limit}s) ==="
  [ "$needs" = gpu ] && why=$NO_GPU
  why=${NO_HEARTHLM:-$why}
  if [ -n "$why" ]; then
    echo "--- $name: skipped: $why"; SKIPPED+=("$name ($why)"); return 1
  fi
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "--- $name: passed in $(( $(date +%s) - t0 ))s"; PASSED+=("$name")
  else
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && rc="$rc, over its ${limit}s"
    echo "--- $name: FAILED (rc=$rc) in $(( $(date +%s) - t0 ))s"; FAILED+=("$name (rc=$rc)")
  fi
  [ "$rc" = 0 ]
}

install_bundle() {
  local bundle=.gpu-bundle
  rm -rf "$SITE"  # an earlier run's install must not stand in for this tree's
  if [ ! -f $bundle/MANIFEST.json ]; then  # no bundle carried: make one, where pip can download
    echo "no $bundle/ (make gpu-bundle, and carry it): building one in $WORK/bundle"
    bundle=$WORK/bundle
    "$PY" tests/gpu_bundle.py build $bundle || return 1
  fi
  local want have
  want=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['tree_sha256'])" $bundle/MANIFEST.json)
  have=$("$PY" tests/gpu_bundle.py tree-hash)
  if [ "$want" != "$have" ]; then
    echo "$bundle/'s hearthlm wheel was built from other sources than this tree's: make gpu-bundle again"
    return 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    $bundle/*.whl || return 1
  "$PY" -c "import sys, hearthlm; print('Python', sys.version.split()[0], '| hearthlm from', hearthlm.__file__)"
}

cupy_ready() {
  if ! "$PY" -c "import cupy" 2>/dev/null; then  # the CuPy of the driver's CUDA major, where pip works
    local major
    major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
    echo "no CuPy: installing cupy-cuda${major}x[ctk] (the driver runs CUDA $major)"
    "$PY" -m pip install -q "cupy-cuda${major}x[ctk]>=14" || return 1
  fi
  "$PY" - <<'EOF'
import cupy
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"cupy {cupy.__version__}: {cupy.cuda.runtime.getDeviceCount()} device(s), {props['name'].decode()}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
from hearthlm.backends.cuda.backend import CUDABackend
CUDABackend()
EOF
}
export -f install_bundle cupy_ready  # `timeout` runs programs: the functions go through bash

if nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  NO_GPU=""
else
  NO_GPU="no GPU"
fi

NO_HEARTHLM=""
step "install .gpu-bundle" 30 any bash -c install_bundle || NO_HEARTHLM="hearthlm is not installed"
step "cupy and the device" 60 gpu bash -c cupy_ready || { [ -n "$NO_GPU" ] || NO_GPU="no usable GPU (see 'cupy and the device')"; }
# nvcc with every warning an error, quants.cuh on the host, each launch's arguments (no GPU needed)
step "cuda kernels: compile and host checks" 45 any \
  "$PY" -m pytest $PYTEST -m "not gpu" tests/test_cuda.py tests/test_cuda_launch.py
step "tiny GGUFs in the real models' shapes" 45 any "$PY" tests/gpu_parity.py models "$WORK/models"
step "op suite on cuda" 90 gpu env HEARTHLM_TEST_BACKENDS=cuda "$PY" -m pytest $PYTEST tests/test_backend_ops.py
# the cpu side compiles its numba kernels cold here: about a minute of this step's limit
step "generation parity: cuda and ngl against cpu" 150 gpu "$PY" tests/gpu_parity.py parity "$WORK/models"
step "decode tok/s" 45 gpu "$PY" tests/gpu_parity.py bench "$WORK/models"

echo; echo "=== gpu_check: $(( $(date +%s) - START ))s ==="
for s in "${PASSED[@]}"; do echo "passed:  $s"; done
for s in "${SKIPPED[@]}"; do echo "skipped: $s"; done
for s in "${FAILED[@]}"; do echo "FAILED:  $s"; done
echo "${#PASSED[@]} passed, ${#FAILED[@]} failed, ${#SKIPPED[@]} skipped"
[ ${#FAILED[@]} -eq 0 ]
