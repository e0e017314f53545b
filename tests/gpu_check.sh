#!/usr/bin/env bash
# One command for a CUDA machine (an H200): install CuPy, then run the cuda backend's op
# parity tests, the golden generation tests on backend "cuda", and `hearthlm bench` of both
# real models on cpu and cuda. Offline machines: put wheels in .whl/ (beside the repo's
# files, or one folder up); they are installed with --no-index. Each step has its own time
# limit so the whole stays under 8 minutes; the summary at the end says what failed.
#   usage: bash tests/gpu_check.sh          (PYTHON=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
FAILED=()

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=$(command -v python3.11 || command -v python3); fi
export PY
pip_q() { "$PY" -m pip --disable-pip-version-check -q "$@"; }

step() {  # step NAME SECONDS CMD...: run with a time limit, remember failures
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name (limit ${limit}s) ==="
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "--- $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || FAILED+=("$name (rc=$rc)")
}

install_deps() {
  local wheels=""
  for d in .whl ../.whl; do [ -d "$d" ] && ls "$d"/*.whl >/dev/null 2>&1 && wheels=$d && break; done
  if [ -n "$wheels" ]; then
    echo "installing the wheels in $wheels (offline)"
    pip_q install --no-index --find-links "$wheels" "$wheels"/*.whl || return 1
    "$PY" -c "import hearthlm" 2>/dev/null ||
      pip_q install --no-index --find-links "$wheels" -e '.[dev]' || return 1
  else
    "$PY" -c "import cupy" 2>/dev/null || pip_q install 'cupy-cuda12x>=13' || return 1
    "$PY" -c "import hearthlm" 2>/dev/null || pip_q install -e '.[dev]' || return 1
  fi
  "$PY" - <<'EOF'
import cupy
n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"cupy {cupy.__version__}, {n} device(s): {props['name'].decode()}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
EOF
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export -f pip_q install_deps  # `timeout` runs programs, so the function goes through bash
step "install cupy" 60 bash -c install_deps
# the kernels compile (NVRTC) on first use; -x: the first failure's traceback is enough
step "cuda op parity tests" 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -rs
step "golden generation on cuda" 120 env HEARTHLM_TEST_BACKENDS=cuda HEARTHLM_REQUIRE_MODELS=1 \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_golden_smollm2.py tests/test_golden_gemma3.py
for model in smollm2-135m-instruct gemma-3-270m; do
  for backend in cuda cpu; do
    limit=$([ "$backend" = cuda ] && echo 35 || echo 45)  # cpu: numba compiles first
    step "bench $model $backend" "$limit" "$PY" -m hearthlm bench --model "$model" --backend "$backend" \
      --prompt-tokens 256 --decode-tokens 64
  done
done

echo; echo "=== gpu_check: $(( $(date +%s) - START ))s ==="
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all steps passed"
