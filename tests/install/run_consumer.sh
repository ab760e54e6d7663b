#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds and runs the consumer
# project against it (find_package(ckpt CONFIG), ckpt::ckpt, ckpt::optimizer).
set -euo pipefail
build="$1"
src="$2"
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-install-XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/ckpt/checkpoint_store.h"
test -f "$work/prefix/include/ckpt/base/status_macros.h"
test ! -e "$work/prefix/include/ckpt/bench" || { echo "benchmark internals were installed"; exit 1; }
cmake -S "$src/tests/install/consumer" -B "$work/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/build/consumer" "$work/store"
