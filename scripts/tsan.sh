#!/usr/bin/env bash
# The ThreadSanitizer suite: builds the optimizer tests with -fsanitize=thread into build-tsan
# (no CUDA, no MPI) and runs the tests labelled tsan (the async save's writer and fence against
# concurrent steps, the checkpointer's collectives, the store's writer threads, and ckpt.dcp's
# writer ownership through the C library from Python). Any report fails the test.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCKPT_TSAN=ON -DCKPT_CUDA=OFF -DCKPT_MPI=OFF \
  -DCKPT_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build build-tsan -j2 --target optimizer_test libckpt_test ckpt_c
TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}" \
  ctest --test-dir build-tsan -L tsan --output-on-failure -j2 --timeout 900
