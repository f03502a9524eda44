#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one call on a device machine:
#   device run (carry [".device"]):  bash scripts/device_checks.sh [TARGETS] [pytest args]
# TARGETS: comma-separated, of tests, processes (TP groups of several processes: the
# multi-process tests, then decode_loop under jax.distributed), bench (every benchmark),
# bench_<name>, decode, startup,
# profile (Nsight Compute over the sanitizer workload, $PROFILE_ARGS),
# sanitize (compute-sanitizer's memcheck, synccheck, racecheck and initcheck over every kernel
# family: scripts/sanitize_kernels.py); all (the default) is every one but sanitize and
# profile. Extra arguments go to pytest, e.g. -k lamport ($TESTS: its files, default tests/;
# $TEST_WORKERS: xdist workers, default 8); $BENCH_ARGS to the benchmarks, e.g.
# BENCH_ARGS="--parts tail". With several GPUs the mesh tests run and the all-reduce and layer
# benchmarks use a real TP mesh. They need the CuTe DSL installed, or .device/cutedsl.tar.xz
# (made by scripts/dsl_bundle.sh; README, "Test"), and pytest-xdist and pytest-timeout.
# Results go to $OUT (default /tmp/out: the benchmarks' tables, and details.tgz: every log);
# the last lines printed are a short summary.
# The target aot (not in all) runs without the DSL: carry ["build/ffi"] (the kernel library,
# python -m jax_kimik3.native_build) and not .device; JAX_KIMIK3_KERNELS=aot.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RESULTS=$OUT; OUT=$OUT/details; mkdir -p "$OUT"  # logs travel back as one archive
pack() { tar czf "$RESULTS/details.tgz" -C "$RESULTS" details && rm -rf "$RESULTS/details"; }
trap pack EXIT
targets=",${1:-all},"
wants() { [[ ($targets == *",all,"* && $1 != sanitize && $1 != profile) || $targets == *",$1,"* || ($1 == bench_* && $targets == *",bench,"*) ]]; }
summary=()
failed=0  # the exit status: 1 if any test run or benchmark failed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $targets == *",aot,"* ]]; then
  # No DSL on the path: every kernel from build/ffi/libjax_kimik3_kernels.so.
  lib_mib=$(du -sm build/ffi | cut -f1)
  aot_env=(env PYTHONPATH="$PWD" JAX_KIMIK3_KERNELS=aot)
  if "${aot_env[@]}" python3 -c "import cutlass" 2>/dev/null; then
    summary+=("aot: FAILED: cutlass imports here; the check needs a host without the DSL")
  elif [[ ! -f build/ffi/libjax_kimik3_kernels.so || $lib_mib -ge 60 ]]; then
    summary+=("aot: FAILED: build/ffi must hold libjax_kimik3_kernels.so, under 60 MiB (${lib_mib} MiB)")
  else
    "${aot_env[@]}" python3 -c "from jax_kimik3 import native; l = native.library(); \
print(f'{l.path}: {len(l.register())} handlers registered, {l.arch}, DSL {l.dsl}')" \
      > "$OUT/aot_library.log" 2>&1
    summary+=("aot library (${lib_mib} MiB, import cutlass fails): $(tail -n 1 "$OUT/aot_library.log")")
    "${aot_env[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=600 \
      tests/test_gpu_native.py "${@:2}" > "$OUT/aot_gpu_tests.log" 2>&1
    summary+=("aot gpu tests: $(tail -n 1 "$OUT/aot_gpu_tests.log")")
    # TP = every GPU: on two, B = 4, 20, 32 and 64 run the split tail (1, 3, 4 and 8 B
    # tiles: tuning.py's TAIL_VARIANTS).
    for batch in 4 20 32 64; do
      "${aot_env[@]}" python3 examples/decode_loop.py --layers 13 --batch $batch --steps 20 \
        --check > "$OUT/aot_decode_loop_b$batch.log" 2>&1
      summary+=("aot decode_loop B=$batch: exit $? | $(grep -h -E 'startup|decode step|check' "$OUT/aot_decode_loop_b$batch.log" | tr '\n' ' ')")
    done
    grep -E "FAILED|Error" "$OUT"/aot_gpu_tests.log "$OUT"/aot_decode_loop_b*.log | head -n 20
  fi
  targets=${targets//,aot,/,}
  if [[ $targets == "," ]]; then printf '%s\n' "${summary[@]}" | tee "$RESULTS/summary.txt"; exit 0; fi
fi
# The CuTe DSL: installed (pip install -e ".[test,cuda13]"), or from the bundle, unpacked once
# per machine (a second run of this script, even alongside, finds it there).
if python3 -c "import cutlass" 2>/dev/null; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keep a DSL found through it
else
  if [[ ! -f /tmp/site/.unpacked ]]; then
    mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site && touch /tmp/site/.unpacked || {
      echo "the CuTe DSL is neither installed nor in .device/cutedsl.tar.xz (scripts/dsl_bundle.sh)"; exit 1; }
  fi
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
fi
if wants tests; then
  # The multi-process tests start their own GPU processes: the target processes runs them alone.
  python3 -m pytest -m gpu -v -p no:cacheprovider -n "${TEST_WORKERS:-8}" --timeout=600 --maxfail=30 \
    --ignore=tests/test_gpu_processes.py ${TESTS:-tests/} "${@:2}" \
    > "$OUT/gpu_tests.log" 2>&1 || failed=1
  summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
fi
if wants processes; then
  python3 -m pytest -m gpu -v -rP -p no:cacheprovider --timeout=900 tests/test_gpu_processes.py \
    > "$OUT/gpu_processes.log" 2>&1 || failed=1
  summary+=("gpu processes tests: $(tail -n 1 "$OUT/gpu_processes.log")")
  # decode_loop as two processes of one TP group under jax.distributed, both on GPU 0 when
  # there is one GPU (no --check: the reference's psum needs NCCL, which refuses one GPU twice).
  port=$((20000 + RANDOM % 20000)) gpus=$(nvidia-smi -L | grep -c '^GPU ')
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$(( gpus > 1 ? i : 0 )) python3 examples/decode_loop.py --layers 13 \
      --batch 8 --steps 20 --coordinator "127.0.0.1:$port" --processes 2 --process-id $i \
      > "$OUT/decode_loop_process$i.log" 2>&1 &
  done
  wait
  for i in 0 1; do
    summary+=("decode_loop process $i of 2: $(grep -h -E 'decode step|checksum|mailbox after step 20' "$OUT/decode_loop_process$i.log" | tr '\n' ' ')")
  done
  sums=$(grep -h checksum "$OUT"/decode_loop_process[01].log | sort -u | wc -l)
  [[ $sums == 1 ]] || { failed=1; summary+=("decode_loop processes: the two ranks' checksums differ or are missing"); }
fi
for bench in attn_res all_reduce layer rank; do
  if wants "bench_$bench"; then
    args_var="BENCH_${bench^^}_ARGS"  # e.g. BENCH_LAYER_ARGS, else BENCH_ARGS
    start=$SECONDS
    python3 -m "benchmarks.bench_$bench" --out "$OUT" ${!args_var:-${BENCH_ARGS:-}} \
      > "$OUT/bench_$bench.log" 2>&1
    status=$?; (( status )) && failed=1
    summary+=("bench_$bench: exit $status in $((SECONDS - start)) s")
    cp "$OUT"/bench_"$bench"*.md "$RESULTS"/ 2>/dev/null
    grep -h -A40 "^|" "$OUT"/bench_"$bench"*.md 2>/dev/null || tail -n 20 "$OUT/bench_$bench.log"
  fi
done
if wants decode; then
  # Every GPU as a TP mesh at B = 8 and 64 (statistics ahead at 8), then TP 8 in virtual TP on
  # the first GPU: each checked against the reference step.
  for run in "b8:--batch 8 --stats-ahead" "b64:--batch 64" "virtual_tp8:--batch 8 --virtual-tp 8"; do
    name=${run%%:*}
    python3 examples/decode_loop.py --layers 13 --steps 20 --check ${run#*:} \
      > "$OUT/decode_loop_$name.log" 2>&1
    summary+=("decode_loop $name: exit $? | $(grep -h -E 'decode step|check' "$OUT/decode_loop_$name.log" | tr '\n' ' ')")
  done
fi
if wants startup; then
  # Process start to the first decode step done: JIT (the DSL compiles every kernel), then a
  # step exported here and loaded in a fresh process (JAX_KIMIK3_KERNELS=jit for both).
  JAX_KIMIK3_KERNELS=jit python3 examples/decode_loop.py --layers 13 --batch 8 --steps 20 \
    > "$OUT/startup_jit.log" 2>&1
  JAX_KIMIK3_KERNELS=jit python3 examples/decode_loop.py --layers 13 --batch 8 \
    --export /tmp/step.bin > "$OUT/startup_export.log" 2>&1
  JAX_KIMIK3_KERNELS=jit python3 examples/decode_loop.py --layers 13 --batch 8 --steps 20 \
    --check --load /tmp/step.bin > "$OUT/startup_exported.log" 2>&1
  summary+=("startup: $(grep -h -E 'startup|decode step|check' "$OUT"/startup_jit.log \
    "$OUT"/startup_exported.log | tr '\n' ' ')")
fi
if wants sanitize; then
  # Each tool over the kernel families it applies to (racecheck: the shared-memory ones).
  # Each TOOL:ARGS, the workload's arguments joined by "+" ($SANITIZE_TOOLS overrides them).
  for run in ${SANITIZE_TOOLS:-memcheck: synccheck: racecheck:--kinds=attn_res,statistics,split,fused+--batches=8 initcheck:--tps=2+--batches=8}; do
    tool=${run%%:*} workload=${run#*:}
    # XLA's GEMM autotuner crashed under the tools (segfaults, H200, 2026-12-01): off here.
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout "${SANITIZE_TIMEOUT:-600}" \
      compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 20 \
      python3 scripts/sanitize_kernels.py ${workload//+/ } > "$OUT/sanitize_$tool.log" 2>&1
    summary+=("sanitize $tool: exit $? | $(grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -n 1) | $(grep -h 'sanitize_kernels:' "$OUT/sanitize_$tool.log")")
  done
fi
if wants profile; then
  # Nsight Compute over the sanitizer's workload ($PROFILE_ARGS, e.g. "--kinds split --tps 2
  # --batches 8"): one pass per kernel (duration, DRAM bytes read, launch shape), clocks as
  # they run, caches flushed before each kernel; the table lists the kernels of the workload.
  # $PROFILE_SECTIONS (e.g. "SpeedOfLight WarpStateStats"): those sections too, for the
  # kernels matching $PROFILE_KERNELS (a regex), printed to profile_details.txt (with
  # SourceCounters, each SASS instruction's stall samples to details/profile_source.csv).
  sections=(); for section in ${PROFILE_SECTIONS:-}; do sections+=(--section "$section"); done
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" ncu --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
    "${sections[@]}" --kernel-name "regex:${PROFILE_KERNELS:-.}" \
    -f -o "$OUT/profile" python3 scripts/sanitize_kernels.py --timeout-ms 5000 \
    ${PROFILE_ARGS:---kinds split --tps 2 --batches 8} > "$OUT/profile.log" 2>&1
  ncu --import "$OUT/profile.ncu-rep" --csv --page raw > "$OUT/profile.csv" 2>>"$OUT/profile.log"
  python3 scripts/profile_table.py "$OUT/profile.csv" | tee "$RESULTS/profile.md"
  if [[ -n ${PROFILE_SECTIONS:-} ]]; then
    ncu --import "$OUT/profile.ncu-rep" --page details > "$RESULTS/profile_details.txt" 2>>"$OUT/profile.log"
    # With SourceCounters: per SASS instruction, its warp-stall samples (where the time goes).
    if [[ ${PROFILE_SECTIONS} == *SourceCounters* ]]; then
      ncu --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/profile_source.csv" 2>>"$OUT/profile.log"
    fi
  fi
  summary+=("profile: $(grep -h 'sanitize_kernels:' "$OUT/profile.log")")
fi
grep -E "FAILED|Error" "$OUT/gpu_tests.log" 2>/dev/null | head -n 20
printf '%s\n' "${summary[@]}" | tee "$RESULTS/summary.txt"
exit $failed
