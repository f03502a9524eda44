#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one call on a device machine:
#   device run (carry [".device"]):  bash scripts/device_checks.sh [TARGETS] [pytest args]
# TARGETS: comma-separated, of tests, bench (every benchmark), bench_<name>, decode; all (the
# default) is every one. Extra arguments go to pytest, e.g. -k lamport; $BENCH_ARGS to the
# benchmarks, e.g. BENCH_ARGS="--parts tail". With several GPUs the
# mesh tests run and the all-reduce and layer benchmarks use a real TP mesh.
# Needs .device/cutedsl.tar.xz (../shared/device/make-cutedsl-bundle). Logs and results go
# to $OUT; the last lines printed are a short summary.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
targets=",${1:-all},"
wants() { [[ $targets == *",all,"* || $targets == *",$1,"* || ($1 == bench_* && $targets == *",bench,"*) ]]; }
summary=()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if wants tests; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 --timeout=600 --maxfail=30 tests/ "${@:2}" \
    > "$OUT/gpu_tests.log" 2>&1
  summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
fi
for bench in attn_res all_reduce layer; do
  if wants "bench_$bench"; then
    python3 "examples/bench_$bench.py" --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench_$bench.log" 2>&1
    summary+=("bench_$bench: exit $?")
    grep -h -A40 "^|" "$OUT"/bench_"$bench"*.md 2>/dev/null || tail -n 20 "$OUT/bench_$bench.log"
  fi
done
if wants decode; then
  for batch in 8 64; do
    python3 examples/decode_loop.py --layers 13 --batch $batch --steps 20 --check \
      > "$OUT/decode_loop_b$batch.log" 2>&1
    summary+=("decode_loop B=$batch: exit $? | $(grep -h -E 'decode step|check' "$OUT/decode_loop_b$batch.log" | tr '\n' ' ')")
  done
fi
grep -E "FAILED|Error" "$OUT/gpu_tests.log" 2>/dev/null | head -n 20
printf '%s\n' "${summary[@]}"
