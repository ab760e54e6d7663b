#!/usr/bin/env bash
# Configures and builds ckpt into build/ (CKPT_CUDA=AUTO unless CKPT_CUDA is set).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCKPT_CUDA="${CKPT_CUDA:-AUTO}" -DCKPT_WERROR=ON
cmake --build build -j2
