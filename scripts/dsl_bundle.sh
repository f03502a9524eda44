#!/usr/bin/env bash
# .device/cutedsl.tar.xz: the CuTe DSL (nvidia-cutlass-dsl, cu13, CPython 3.12, x86-64) for a
# GPU machine that lacks it, as one archive to carry there and unpack (scripts/device_checks.sh
# unpacks it into /tmp/site and puts it on PYTHONPATH). $CUTE_DSL_VERSION picks the version.
set -euo pipefail
version=${CUTE_DSL_VERSION:-4.8.1}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/wheels" \
  "nvidia-cutlass-dsl==$version" "nvidia-cutlass-dsl-libs-base==$version" \
  "nvidia-cutlass-dsl-libs-core==$version" "nvidia-cutlass-dsl-libs-cu13==$version"
mkdir -p "$work/site" "$root/.device"
for wheel in "$work"/wheels/*.whl; do unzip -oq "$wheel" -d "$work/site"; done
rm -rf "$work/site/nvidia_cutlass_dsl/dsl_packages/iket"  # a profiler the kernels do not need
tar -C "$work/site" -cf - . | xz -9 -T0 > "$root/.device/cutedsl.tar.xz"
echo "$root/.device/cutedsl.tar.xz: $(du -m "$root/.device/cutedsl.tar.xz" | cut -f1) MiB"
