#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one call on the H200 device machine:
#   device run (carry [".device"]):  bash scripts/device_checks.sh [tests|bench|bench_<name>|all]
# (extra arguments after the first go to pytest, e.g. -k lamport)
# Needs .device/cutedsl.tar.xz (../shared/device/make-cutedsl-bundle). Logs and results go
# to $OUT; the last lines printed are a short summary.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
summary=()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 --timeout=300 --maxfail=30 tests/ "${@:2}" \
    > "$OUT/gpu_tests.log" 2>&1
  summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
fi
for bench in attn_res all_reduce; do
  if [[ $what == all || $what == bench || $what == "bench_$bench" ]]; then
    python3 "examples/bench_$bench.py" --out "$OUT" > "$OUT/bench_$bench.log" 2>&1
    summary+=("bench_$bench: exit $?")
    cat "$OUT/bench_$bench.md" 2>/dev/null || tail -n 20 "$OUT/bench_$bench.log"
  fi
done
grep -E "FAILED|Error" "$OUT/gpu_tests.log" 2>/dev/null | head -n 20
printf '%s\n' "${summary[@]}"
