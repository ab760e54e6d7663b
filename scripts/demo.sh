#!/usr/bin/env bash
# ckpt's main job end to end, until the demo trainer exists: save and load synthetic state
# through the store (measured against the disk's O_DIRECT bounds), then inspect and verify it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
dir=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-demo-XXXXXX")
trap 'rm -rf "$dir"' EXIT
./build/cli/ckpt-tool bench io --dir "$dir" --size 256M --ranks 2 --keep
./build/cli/ckpt-tool inspect "$dir/ckpt-bench"
./build/cli/ckpt-tool verify "$dir/ckpt-bench" --all
