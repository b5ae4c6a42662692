#!/usr/bin/env bash
# Compile-checks the CUDA glue (csrc/ops/*_cuda.cu: the ops' CUDA registrations, argument checks, device guards and
# streams) against the installed torch's headers with nvcc, without a GPU and without linking. A CPU torch wheel
# ships the c10/ATen CUDA headers but cannot link CUDA code, so this is what CI can check of the glue. The glue
# includes only c10/cuda headers, which need the CUDA runtime headers (not cuBLAS/cuSPARSE). A CPU wheel lacks the
# one generated c10 CUDA header; it is written into the build folder.
#   scripts/cuda-glue-check.sh [python]      (default .venv/bin/python, which must have torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ ! -x "$NVCC" ]; then echo "cuda-glue-check: no nvcc on this machine; skipped"; exit 0; fi
OUT=build/cuda-glue-check
MACROS=c10/cuda/impl/cuda_cmake_macros.h
mkdir -p "$OUT/include/$(dirname "$MACROS")"
TORCH_INC=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
if [ ! -f "$TORCH_INC/$MACROS" ]; then
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/include/$MACROS"
fi
FLAGS=(-std=c++17 --expt-relaxed-constexpr -arch=sm_90 -Icsrc -I"$OUT/include" -I"$TORCH_INC"
       -I"$TORCH_INC/torch/csrc/api/include" -I"$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")")
SOURCES=(csrc/ops/*_cuda.cu)
echo "cuda-glue-check: $("$NVCC" --version | tail -1), ${#SOURCES[@]} files, torch $("$PY" -c 'import torch; print(torch.__version__)') headers"
pids=()
for f in "${SOURCES[@]}"; do
  "$NVCC" -c "$f" -o "$OUT/$(basename "$f" .cu).o" "${FLAGS[@]}" > "$OUT/$(basename "$f" .cu).log" 2>&1 &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do sleep 0.2; done
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    failed=1
    echo "cuda-glue-check: ${SOURCES[$i]} does not compile:"
    grep -E "error" "$OUT/$(basename "${SOURCES[$i]}" .cu).log" | head -20
  fi
done
[ "$failed" = 0 ] && echo "cuda-glue-check: all ${#SOURCES[@]} CUDA glue files compile"
exit "$failed"
