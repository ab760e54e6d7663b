#!/usr/bin/env bash
# Installs the Debian 12 packages ckpt builds and tests with (as root; skipped when present).
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config libabsl-dev liburing-dev libzstd-dev libcli11-dev
      libopenmpi-dev openmpi-bin
      libxxhash-dev libre2-dev libopenblas-dev nlohmann-json3-dev libgtest-dev libgmock-dev clang libclang-rt-14-dev
      python3-torch python3-pytest python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
