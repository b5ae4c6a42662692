#!/usr/bin/env bash
# On a CUDA machine: build fastdist, run what the 2-core CI VM cannot (the CUDA op tests, the kernel benchmarks on
# the GPU, the multi-rank benchmarks on cores of their own), and write every log and result under
# bench/gpu/<date>-<gpu>/ (or DIR). Commit that folder.
#
#   scripts/gpu-check.sh [--phase cuda|ranks|extra|all] [DIR]
#
# The phases fit one 10-minute call each on a lent GPU machine (16 cores), most important first:
#   cuda   CUDA build, op tests on CPU and CUDA, kernel benchmarks on the GPU (count_sketch's % of HBM, also on a
#          1 GiB gradient where a launch is no longer the floor), moe_layout on CUDA against the torch path
#   ranks  CPU-only build; the MoE benchmark on 4 and 8 ranks with one expert each (issue 5's 1.1x over
#          shadowing) and sparse-lm at the 128 MiB embedding on 4 ranks over 1 Gbit/s (issue 3's end-to-end figure)
#   extra  CUDA build, C++ kernel tests and the TP GEMM check on the GPU, memory tests and bench
# Every step has its own time limit, and a failed step does not stop the ones after it. When $OUT is set (the
# device tool's result folder), the phase's folder is also packed into $OUT/gpu-check-<phase>.tar.gz, one file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

phase=all
if [ "${1:-}" = "--phase" ]; then phase=${2:?"--phase needs cuda, ranks, extra or all"}; shift 2; fi
case "$phase" in cuda | ranks | extra | all) ;; *) echo "gpu-check: unknown phase '$phase'"; exit 2 ;; esac
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-' | tr -s '-')
[ -n "$gpu" ] || { echo "gpu-check: no NVIDIA GPU visible (nvidia-smi found none)"; exit 1; }
out=${1:-bench/gpu/$(date +%F)-$gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=()

log() { echo "=== [$(date +%T)] $*" | tee -a "$out/summary.txt"; }

# step NAME SECONDS COMMAND...: runs COMMAND (through bash -c) under a time limit, its output to $out/NAME.txt and
# the terminal; records the exit code and the seconds it took.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  log "$name (limit ${limit}s): $*"
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$limit" bash -c "$*" 2>&1 | grep -v -e '^\[W' -e '^[a-z-]* \[' | tee "$out/$name.txt"
  rc=${PIPESTATUS[0]}
  set -e
  log "$name: exit $rc after $(($(date +%s) - t0))s$([ "$rc" -eq 124 ] && echo ' (time limit)')"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

# build cuda|cpu: the extension in place; CPU-only is a minute, CUDA (sm_90) a few.
build() {
  local kind=$1 what=cpu
  if [ "$kind" = cuda ]; then
    export FASTDIST_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    unset FASTDIST_FORCE_CPU
    what="cuda, arch $TORCH_CUDA_ARCH_LIST"
  else
    export FASTDIST_FORCE_CPU=1
    unset FASTDIST_FORCE_CUDA
  fi
  log "build ($what)"
  rm -f python/fastdist/_C*.so
  # a build folder per kind: a CPU build must not relink objects compiled with the CUDA ops registered
  if ! MAX_JOBS=$(nproc) $PY setup.py build_ext --inplace --build-temp "build/temp-gpu-check-$kind" \
    >"$out/build-$kind.log" 2>&1; then
    tail -50 "$out/build-$kind.log"
    log "build ($kind) FAILED: see build-$kind.log"
    failed+=("build-$kind")
    return 1
  fi
  $PY -m fastdist.env | tee "$out/env-$kind.txt"
}

phase_cuda() {
  build cuda || return 0
  step pytest-ops 300 "$PY -m pytest tests/ops -q -p no:cacheprovider"
  step kernels-cuda 240 "$PY -m fastdist.bench kernels --device cuda --json $out/kernels-cuda.json \
    --plot $out/kernels-cuda.png"
  # the default 128 MiB gradient's 2% is 2.5 MiB of values, under a microsecond of HBM: a launch costs more
  step kernels-cuda-1gib 120 "$PY -m fastdist.bench kernels --device cuda \
    --ops count_sketch,count_sketch_decode,count_sketch_decode_units --sketch-shape 262144x1024 \
    --json $out/kernels-cuda-1gib.json"
}

phase_ranks() {
  build cpu || return 0
  # issue 5's 1.1x over FasterMoE-style shadowing needs >= 4 ranks that do not share cores (the 2-core VM cannot)
  for ranks in 4 8; do
    step "moe-cpu-${ranks}r-1epr" 200 "$PY -m fastdist.bench moe --ranks $ranks --experts-per-rank 1 --steps 20 \
      --json $out/moe-cpu-${ranks}r-1epr.json --plot $out/moe-cpu-${ranks}r-1epr.png"
  done
  step parallel-2x2x2-8r 300 "$PY -m pytest tests/parallel/test_engine.py -q -p no:cacheprovider -k 2x2x2_mesh"
  # issue 3's end-to-end step time with a core per rank (2-core VM: the 4 ranks' compute is most of a step; even
  # with a core each, one rank's 106 ms of compute bounds the sketch's gain over AGsparse near 1.36x: README)
  if $PY -c "import sys; from fastdist import netsim; ok, why = netsim.available(); print(why); sys.exit(not ok)" \
    | tee -a "$out/summary.txt"; then
    step sparse-lm-cpu-4r-1gbit-128mib 240 "$PY -m fastdist.bench sparse-lm --ranks 4 --net 1gbit --steps 60 \
      --embed-dim 1024 --batch 48 --methods agsparse,auto-bg,sketch-0.2x+ef,sketch-0.3x+ef --sketch-sizes 0.2,0.3 \
      --json $out/sparse-lm-cpu-4r-1gbit-128mib.json --plot $out/sparse-lm-cpu-4r-1gbit-128mib.png"
  else
    log "sparse-lm skipped: no simulated network here"
  fi
}

phase_extra() {
  build cuda || return 0
  log "C++ kernel tests"
  if cmake -S . -B build/cmake-gpu -DCMAKE_BUILD_TYPE=Release >"$out/cmake.log" 2>&1 &&
    cmake --build build/cmake-gpu -j"$(nproc)" >>"$out/cmake.log" 2>&1; then
    step ctest 120 "ctest --test-dir build/cmake-gpu --output-on-failure"
  else
    log "cmake build FAILED: see cmake.log"
    failed+=(cmake)
  fi
  # issue 6's GPU bound: an [8192, 8192] x [8192, 8192] bf16 GEMM in 4 row chunks costs <= 5% over one GEMM
  step tp-gemm-check 60 "$PY -m fastdist.bench tp --gemm-check 8192,8192,8192 --json $out/tp-gemm-check.json"
  step pytest-memory 150 "$PY -m pytest tests/memory -q -p no:cacheprovider"
  step memory-cuda 200 "$PY -m fastdist.bench memory --device cuda --scale gpt --models resnet50,transformer \
    --memory-cap 20 --json $out/memory-cuda.json --plot $out/memory-cuda.png"
}

for p in cuda ranks extra; do
  if [ "$phase" = all ] || [ "$phase" = "$p" ]; then "phase_$p"; fi
done

if [ ${#failed[@]} -gt 0 ]; then
  log "done ($phase): results in $out; FAILED: ${failed[*]}"
else
  log "done ($phase): results in $out; every step passed"
fi
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar -czf "$OUT/gpu-check-$phase.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
  echo "packed into $OUT/gpu-check-$phase.tar.gz"
fi
[ ${#failed[@]} -eq 0 ]
