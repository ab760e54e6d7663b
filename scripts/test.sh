#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds, runs every ctest (slow label included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j2 --timeout 900
