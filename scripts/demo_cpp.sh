#!/usr/bin/env bash
# The C++ demo trainer end to end (the Python demo, scripts/demo.sh, is the main job): the demo trainer (demo/demo_trainer.cc) trains a small model on the
# CPU engine over 2 data-parallel ranks with a warmup + cosine learning rate, saving every 4 steps
# through Checkpointer's async save (the next step runs while it is written); it is killed with
# SIGKILL while the async save of step 10 is in flight, resumes from LATEST (step 8) on 3 ranks and
# must end bit for bit where an uninterrupted run ends; then ckpt-tool inspects and verifies the
# store and the exported model; export-hf and reshard rewrite LATEST and diff finds them equal.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
dir=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-demo-XXXXXX")
trap 'rm -rf "$dir"' EXIT
trainer=./build/demo/ckpt-demo-trainer
status=0
"$trainer" --out "$dir" --steps 12 --save-every 4 --crash-at 10 || status=$?
if [ "$status" -ne 137 ]; then
  echo "demo: the first run should have died of SIGKILL (137), it ended with $status" >&2
  exit 1
fi
echo "--- the process is gone; run it again on the same store"
"$trainer" --out "$dir" --steps 12 --save-every 4 --resume --ranks 3
./build/cli/ckpt-tool inspect "$dir/store"
./build/cli/ckpt-tool verify "$dir/store" --all
./build/cli/ckpt-tool verify "$dir/final-model"
echo "--- operators' tools: export LATEST again, reshard it for 4 ranks, compare"
./build/cli/ckpt-tool export-hf "$dir/store" "$dir/exported"
./build/cli/ckpt-tool diff "$dir/final-model" "$dir/exported"
./build/cli/ckpt-tool reshard "$dir/store" "$dir/store-dp4" --dp 4 --bucket-elems 20000
./build/cli/ckpt-tool diff "$dir/store" "$dir/store-dp4"
