#!/bin/bash
# ckpt's CPU AdamW step against torch's fused CPU AdamW on the same machine, alternating runs so
# that both see the same host (shared hosts drift by tens of percent between minutes). Needs
# python3 with torch; ckpt-tool from build/ unless --tool says otherwise.
#   bench/adamw_vs_torch.sh [--params N] [--threads T] [--rounds R] [--grad-dtype F32|BF16|F16]
#                           [--moments F32|BF16] [--torch-huge-pages] [--tool PATH]
# --grad-dtype and --moments apply to ckpt only: torch's fused step keeps everything in FP32.
# --torch-huge-pages runs torch with THP_MEM_ALLOC_ENABLE=1, so its CPU allocator asks for
# transparent huge pages as ckpt's slabs do (torch's default is 4 KiB pages unless the system
# sets THP to "always").
# Prints each round and then the medians and the median of the per-round ratios.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
params=1000000000 threads=16 rounds=5 grad=F32 moments=F32 torch_thp=0 tool="$here/../build/cli/ckpt-tool"
while [ $# -gt 0 ]; do
  case "$1" in
    --params) params=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --grad-dtype) grad=$2; shift 2 ;;
    --moments) moments=$2; shift 2 ;;
    --torch-huge-pages) torch_thp=1; shift ;;
    --tool) tool=$2; shift 2 ;;
    *) echo "adamw_vs_torch.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for r in $(seq 1 "$rounds"); do
  # Who goes first alternates, so neither always runs on a warmer or cooler host.
  if [ $((r % 2)) -eq 1 ]; then order="ckpt torch"; else order="torch ckpt"; fi
  for who in $order; do
    if [ "$who" = ckpt ]; then
      line=$("$tool" bench adamw --params "$params" --threads "$threads" --steps 4 \
               --grad-dtype "$grad" --moments "$moments" --json)
    else
      line=$(THP_MEM_ALLOC_ENABLE=$torch_thp python3 "$here/torch_adamw.py" --params "$params" \
               --threads "$threads" --steps 4)
    fi
    echo "{\"round\": $r, \"who\": \"$who\", \"result\": $(echo "$line" | tr -d '\n')}" >>"$results"
  done
done
python3 - "$results" "$grad grads, $moments moments" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
grad = sys.argv[2]
ours, torch_step, torch_copy, ratios, ratios_copy = [], [], [], [], []
for r in sorted({row["round"] for row in rows}):
    c = next(x["result"]["cpu"] for x in rows if x["round"] == r and x["who"] == "ckpt")
    t = next(x["result"] for x in rows if x["round"] == r and x["who"] == "torch")
    ours.append(c["gparams_per_s"]); torch_step.append(t["step_gparams_per_s"])
    torch_copy.append(t["step_and_copy_gparams_per_s"])
    ratios.append(ours[-1] / torch_step[-1]); ratios_copy.append(ours[-1] / torch_copy[-1])
    print(f"round {r}: ckpt ({grad}) {ours[-1]:.2f} Gparam/s (ratio to its triad bound "
          f"{c['ratio']:.2f}, to its own streams {c['step_shaped_ratio']:.2f})   torch step "
          f"{torch_step[-1]:.2f}, step+BF16 copy {torch_copy[-1]:.2f}   ckpt/torch {ratios[-1]:.2f}")
med = statistics.median
first = next(x["result"] for x in rows if x["who"] == "torch")
version = first["torch"] + (" (huge pages)" if first.get("huge_pages") else "")
print(f"median: ckpt {med(ours):.2f} Gparam/s   torch {version} "
      f"fused step {med(torch_step):.2f}, step+copy {med(torch_copy):.2f}   ckpt/torch step "
      f"{med(ratios):.2f} (rounds {min(ratios):.2f}..{max(ratios):.2f}), ckpt/torch step+copy "
      f"{med(ratios_copy):.2f}")
PY
