#!/usr/bin/env bash
# ckpt's main job end to end, in Python: a small GPT (demo/python/train_gpt.py, a few million
# parameters) learns the licence texts in /usr/share/common-licenses with ckpt.torch.StagedAdamW
# (torch's LambdaLR, warmup then cosine) and async saves every 10 steps; it is killed with
# SIGKILL while the async save of step 35 is in flight, resumes from LATEST (step 30) in a fresh
# process and must end bit for bit where an uninterrupted run ends; then ckpt-tool inspects the
# store, exports the model as safetensors, reshards the last step for 4 ranks (diff: equal) and
# verifies the export and every step.
# The C++ demo trainer's run is scripts/demo_cpp.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh  # Installs the Debian packages (python3-torch among them) and builds.
dir=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-demo-XXXXXX")
trap 'rm -rf "$dir"' EXIT
export CKPT_LIB=$PWD/build/capi/libckpt_c.so
py=/usr/bin/python3  # Debian's, with python3-torch.
train=(demo/python/train_gpt.py --steps 60 --save-every 10)
status=0
"$py" "${train[@]}" --out "$dir/run" --crash-at 35 || status=$?
if [ "$status" -ne 137 ]; then
  echo "demo: the first run should have died of SIGKILL (137), it ended with $status" >&2
  exit 1
fi
echo "--- the process is gone; run it again on the same store"
"$py" "${train[@]}" --out "$dir/run" --resume --dump "$dir/resumed.pt"
echo "--- an uninterrupted run of the same job, for comparison"
"$py" "${train[@]}" --out "$dir/reference" --no-save --dump "$dir/reference.pt" | tail -1
"$py" demo/python/same_state.py "$dir/resumed.pt" "$dir/reference.pt"
echo "--- the checkpoints, seen by ckpt-tool"
./build/cli/ckpt-tool inspect "$dir/run/ckpt" | sed -n "1,/^tensors:/p;/^optimizer:/,\$p"
./build/cli/ckpt-tool export-hf "$dir/run/ckpt" "$dir/model"
./build/cli/ckpt-tool reshard "$dir/run/ckpt" "$dir/ckpt-dp4" --dp 4 --bucket-elems 1000000
./build/cli/ckpt-tool diff "$dir/run/ckpt" "$dir/ckpt-dp4"
./build/cli/ckpt-tool verify "$dir/model"
./build/cli/ckpt-tool verify "$dir/run/ckpt" --all
