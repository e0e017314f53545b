#!/usr/bin/env bash
# The cuda backend on a GPU machine as the project is lent one: no network, a working tree of
# at most 64 MiB (no real models: tiny ones are written on the spot), Python 3.12 with numpy
# and cupy-cuda13x already there. Prepare on a machine with network: `make gpu-bundle`
# (.gpu-bundle/: hearthlm's wheel and the wheels that machine lacks), carry .gpu-bundle along
# (it is git-ignored: the device tool's `carry`), then there:  bash tests/gpu_check.sh
# (PYTHON=... picks the interpreter). Nothing is downloaded or built there: without a current
# bundle, or without CuPy, the check says so in one line and the steps that need it skip.
# Every step runs under its own time limit (under 11 minutes in all; about 5 on the H200), whatever failed before
# it, and the summary at the end lists each. Without a GPU the steps that need one say
# 'skipped: no GPU' and the others run. Where $OUT is set (the device tool's output folder):
# $OUT/gpu_check.log (everything printed), $OUT/gpu_check.json (each step's status, seconds
# and reason, versions; rewritten after every step), $OUT/<step>.xml (pytest's JUnit reports).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-/tmp/hearthlm-gpu-check}
SITE=$WORK/site  # the bundle goes here (--target), so nothing of the machine's is replaced
OUT=${OUT:-}
export PY WORK SITE OUT PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$WORK"
if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
  exec 3>&1 4>&2 > >(tee "$OUT/gpu_check.log") 2>&1
  TEE_PID=$!
fi
STEPS=$WORK/steps.tsv VERSIONS=$WORK/versions.json WHY=$WORK/why  # WHY: a step's own one-line reason
export VERSIONS WHY
: > "$STEPS"; echo "{}" > "$VERSIONS"
PASSED=() FAILED=() SKIPPED=()
# no -x: every failure shows. The machine's pytest has no pytest-asyncio, whose ini keys it warns of
PYTEST="-q -rs --tb=short -p no:cacheprovider -W ignore::pytest.PytestConfigWarning"

write_json() {  # write_json true|false: $OUT/gpu_check.json from the steps so far
  [ -n "$OUT" ] || return 0
  "$PY" - "$1" "$STEPS" "$VERSIONS" "$OUT/gpu_check.json" "$START" "$(date +%s)" <<'EOF' ||
import json, sys, time
complete, steps_f, versions_f, out, start, now = sys.argv[1:]
steps = []
for line in open(steps_f):
    name, status, secs, limit, reason = line.rstrip("\n").split("\t")
    steps.append(dict(name=name, status=status, seconds=int(secs), limit_seconds=int(limit), reason=reason))
count = lambda s: sum(st["status"] == s for st in steps)
summary = dict(complete=complete == "true", ok=complete == "true" and count("failed") == 0,
               passed=count("passed"), failed=count("failed"), skipped=count("skipped"),
               total_seconds=int(now) - int(start),
               started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(int(start))),
               versions=json.load(open(versions_f)), steps=steps, log="gpu_check.log")
with open(out + ".tmp", "w") as f:
    json.dump(summary, f, indent=1)
    f.write("\n")
__import__("os").replace(out + ".tmp", out)
EOF
  echo "gpu_check: could not write $OUT/gpu_check.json"
}

record() {  # record NAME passed|failed|skipped SECONDS LIMIT REASON
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >> "$STEPS"
  write_json false
}

step() {  # step NAME SECONDS NEEDS CMD...   NEEDS: none, hearthlm, gpu, or hearthlm,gpu
  local name=$1 limit=$2 needs=$3 why=""; shift 3
  echo; echo "=== $name (limit ${limit}s) ==="
  case ",$needs," in *,gpu,*) why=$NO_GPU ;; esac
  case ",$needs," in *,hearthlm,*) why=${NO_HEARTHLM:-$why} ;; esac
  if [ -n "$why" ]; then
    echo "--- $name: skipped: $why"; SKIPPED+=("$name ($why)"); record "$name" skipped 0 "$limit" "$why"
    return 1
  fi
  local t0 rc secs reason
  rm -f "$WHY"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then
    echo "--- $name: passed in ${secs}s"; PASSED+=("$name"); record "$name" passed "$secs" "$limit" ""
    return 0
  fi
  reason="rc=$rc"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then reason="rc=$rc, over its ${limit}s"; fi
  [ -s "$WHY" ] && reason="$reason: $(head -c 600 "$WHY")"
  echo "--- $name: FAILED ($reason) in ${secs}s"; FAILED+=("$name ($reason)")
  record "$name" failed "$secs" "$limit" "$reason"
  return 1
}

install_bundle() {
  local bundle=.gpu-bundle want have remake="run \`make gpu-bundle\` on a machine with network and carry .gpu-bundle (the device tool's carry)"
  refuse() { echo "gpu_check: $*; the steps that need hearthlm are skipped"; echo "$*" > "$WHY"; }
  rm -rf "$SITE"  # an earlier run's install must not stand in for this tree's
  if [ ! -f $bundle/MANIFEST.json ]; then
    refuse "no $bundle/ here: $remake"
    return 1
  fi
  want=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['tree_sha256'])" $bundle/MANIFEST.json)
  have=$("$PY" tests/gpu_bundle.py tree-hash)
  if [ "$want" != "$have" ]; then
    refuse "$bundle/ is stale (its hearthlm wheel was built from other sources than this tree): $remake"
    return 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    $bundle/*.whl || return 1
  "$PY" -c "import sys, hearthlm; print('Python', sys.version.split()[0], '| hearthlm from', hearthlm.__file__)"
}

cupy_ready() {
  local err
  if ! err=$("$PY" -c "import cupy" 2>&1); then  # never pip here: the GPU machine has no network
    echo "no CuPy importable by $PY (${err##*$'\n'}): CuPy for CUDA 13 comes preinstalled on the GPU machine; elsewhere pip install 'hearthlm[gpu-cuda13]' (or PYTHON= another interpreter); not installing it here" | tee "$WHY"
    return 1
  fi
  "$PY" - <<'EOF'
import os
import cupy
props = cupy.cuda.runtime.getDeviceProperties(0)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
print(f"cupy {cupy.__version__}: {cupy.cuda.runtime.getDeviceCount()} device(s), {name}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
if not os.environ.get("NO_HEARTHLM"):
    from hearthlm.backends.cuda.backend import CUDABackend
    CUDABackend()
    print("hearthlm's CUDABackend: ready")
EOF
}

versions() {  # the versions that matter, printed and kept for the JSON summary
  "$PY" - "$VERSIONS" <<'EOF'
import json, platform, re, subprocess, sys
from importlib import metadata
v = {"python": platform.python_version(), "python_executable": sys.executable}
for name in ("numpy", "numba", "cupy", "hearthlm"):
    try:
        mod = __import__(name)
        v[name] = getattr(mod, "__version__", None) or metadata.version(name)
    except Exception as e:
        v[name] = None
        v[name + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    v["gpus"] = [line.strip() for line in smi.stdout.splitlines() if line.strip()]
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"Driver Version: *([\d.]+).*CUDA Version: *([\d.]+)", head)
    if m:
        v["nvidia_driver"], v["driver_cuda"] = m.groups()
except (OSError, subprocess.SubprocessError) as e:
    v["gpus"] = []
    v["nvidia_smi_error"] = str(e)[:200]
if v.get("cupy"):
    import cupy
    for key, fn in (("cuda_runtime", cupy.cuda.runtime.runtimeGetVersion),
                    ("cuda_driver_api", cupy.cuda.runtime.driverGetVersion)):
        try:
            n = fn()
            v[key] = f"{n // 1000}.{n % 1000 // 10}"
        except Exception as e:
            v[key] = f"unavailable ({type(e).__name__})"
    try:
        v["nvrtc"] = "%d.%d" % cupy.cuda.nvrtc.getVersion()
    except Exception as e:
        v["nvrtc"] = f"unavailable ({type(e).__name__})"
json.dump(v, open(sys.argv[1], "w"), indent=1)
print("versions:", " | ".join(f"{k} {v[k]}" for k in ("python", "numpy", "numba", "cupy", "hearthlm",
                                                      "nvidia_driver", "driver_cuda", "cuda_runtime",
                                                      "cuda_driver_api", "nvrtc") if k in v))
for g in v["gpus"]:
    print("gpu:", g)
EOF
}
export -f install_bundle cupy_ready versions  # `timeout` runs programs: the functions go through bash

if nvidia-smi -L >/dev/null 2>&1; then
  NO_GPU=""
else
  NO_GPU="no GPU"
fi

NO_HEARTHLM=""
step "install .gpu-bundle" 30 none bash -c install_bundle || NO_HEARTHLM="hearthlm is not installed (see 'install .gpu-bundle')"
export NO_HEARTHLM
echo; timeout 60 bash -c versions || echo "gpu_check: could not read the versions"
step "cupy and the device" 60 gpu bash -c cupy_ready || { [ -n "$NO_GPU" ] || NO_GPU="no usable GPU (see 'cupy and the device')"; }
# nvcc with every warning an error, NVRTC with CuPy's own flags, quants.cuh on the host, each
# launch's arguments (no GPU needed)
step "cuda kernels: nvcc, NVRTC and host checks" 45 hearthlm \
  "$PY" -m pytest $PYTEST ${OUT:+"--junitxml=$OUT/cuda-kernels.xml"} -m "not gpu" tests/test_cuda.py tests/test_cuda_nvrtc.py \
  tests/test_cuda_launch.py
step "tiny GGUFs in the real models' shapes" 45 hearthlm "$PY" tests/gpu_parity.py models "$WORK/models"
step "op suite on cuda" 75 hearthlm,gpu env HEARTHLM_TEST_BACKENDS=cuda \
  "$PY" -m pytest $PYTEST ${OUT:+"--junitxml=$OUT/op-suite.xml"} tests/test_backend_ops.py
# the cpu side compiles its numba kernels cold here: about a minute of this step's limit
step "vision: Gemma 3's tower and image prompts on cuda against llama.cpp's" 90 hearthlm,gpu env HEARTHLM_TEST_BACKENDS=cuda \
  "$PY" -m pytest $PYTEST ${OUT:+"--junitxml=$OUT/vision.xml"} tests/test_vision.py -k "llama_cpp"
step "generation parity: cuda and ngl against cpu" 150 hearthlm,gpu "$PY" tests/gpu_parity.py parity "$WORK/models"
step "CUDA graphs: replayed decoding as eager" 90 hearthlm,gpu "$PY" tests/gpu_parity.py graphs "$WORK/models"
step "decode tok/s" 45 hearthlm,gpu "$PY" tests/gpu_parity.py bench "$WORK/models"
step "speed: a Qwen2.5-0.5B shape, 1 and 16 streams, prefill 512" 90 hearthlm,gpu "$PY" tests/gpu_parity.py speed "$WORK/models"
step "speed without CUDA graphs" 60 hearthlm,gpu env HEARTHLM_CUDA_GRAPHS=0 "$PY" tests/gpu_parity.py speed "$WORK/models"

echo; echo "=== gpu_check: $(( $(date +%s) - START ))s ==="
for s in "${PASSED[@]}"; do echo "passed:  $s"; done
for s in "${SKIPPED[@]}"; do echo "skipped: $s"; done
for s in "${FAILED[@]}"; do echo "FAILED:  $s"; done
echo "${#PASSED[@]} passed, ${#FAILED[@]} failed, ${#SKIPPED[@]} skipped"
write_json true
if [ -n "$OUT" ]; then
  echo "gpu_check: log in $OUT/gpu_check.log, summary in $OUT/gpu_check.json"
  exec 1>&3 2>&4 3>&- 4>&-  # close tee's pipe and let it finish writing the log
  wait "$TEE_PID" 2>/dev/null
fi
[ ${#FAILED[@]} -eq 0 ]
