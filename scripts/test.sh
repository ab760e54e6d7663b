#!/usr/bin/env bash
# The whole test suite: installs dependencies (Debian packages, and .venv for the current torch),
# builds, runs every ctest (slow label included),
# then the ThreadSanitizer build's tests (label tsan), then runs each fuzzer briefly.
set -euo pipefail
cd "$(dirname "$0")/.."
# The current Python stack (.venv) before the build, whose configure adds its pytest run.
bash scripts/deps.sh
bash scripts/venv.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j2 --timeout 900
# The async save's threads under ThreadSanitizer (label tsan, its own build in build-tsan).
bash scripts/tsan.sh
# A short bounded run of every libFuzzer target (clang, ASan + UBSan); longer runs: docs/fuzzing.md.
bash scripts/fuzz.sh "${CKPT_FUZZ_SECONDS:-15}"
