#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) into build-fuzz/ and runs each for
# ${1:-20} seconds on a copy of its checked-in seed corpus. Exits non-zero on any finding.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-20}"
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCKPT_BUILD_FUZZERS=ON \
  -DCKPT_BUILD_TESTS=OFF -DCKPT_CUDA=OFF > /dev/null
cmake --build build-fuzz -j2 --target manifest_fuzz safetensors_fuzz hf_index_fuzz optimizer_record_fuzz \
  store_fuzz
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-fuzz-XXXXXX")
trap 'rm -rf "$work"' EXIT
# Each target is <directory>/<name>: binary build-fuzz/<directory>/<name>_fuzz, seeds in
# <directory>/corpus/<name>/.
for spec in formats/fuzz/manifest formats/fuzz/safetensors formats/fuzz/hf_index \
    formats/fuzz/optimizer_record libckpt/fuzz/store; do
  dir="${spec%/*}"
  target="${spec##*/}"
  mkdir -p "$work/$target"
  cp "$dir/corpus/$target"/* "$work/$target/"
  echo "fuzz: $target for ${seconds}s"
  ./build-fuzz/$dir/${target}_fuzz -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/" "$work/$target" 2>&1 | grep -E "^(Done|#[0-9]+ +DONE)|ERROR|SUMMARY" || true
  if ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* >/dev/null 2>&1; then
    echo "fuzz: $target found a failing input:"; ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* 2>/dev/null
    exit 1
  fi
done
echo "fuzz: no findings"
