#!/usr/bin/env bash
# Real processes under mpirun (issue #10): 3 ranks train and save; 2 ranks load and continue,
# bit for bit with an uninterrupted 2-rank run; a save with one rank SIGKILLed half-way commits
# nothing and the previous step still verifies.
set -euo pipefail
job="$1"
tool="$2"
work=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-mpi-XXXXXX")
trap 'rm -rf "$work"' EXIT
mpi=(timeout -k 5 120 mpirun --oversubscribe)
if [ "$(id -u)" = 0 ]; then mpi+=(--allow-run-as-root); fi
"${mpi[@]}" -np 3 "$job" --root "$work/ckpt" --steps-from 0 --steps-to 3 --save 3
"${mpi[@]}" -np 2 "$job" --root "$work/ckpt" --load --steps-from 3 --steps-to 5 --dump "$work/resumed"
"${mpi[@]}" -np 2 "$job" --root "$work/straight" --steps-from 0 --steps-to 5 --dump "$work/straight"
cat "$work"/resumed.rank* | sort -u > "$work/a"
cat "$work"/straight.rank* | sort -u > "$work/b"
test "$(wc -l < "$work/a")" -ge 5152  # 5150 elements and 2 groups
cmp "$work/a" "$work/b"
echo "resumed at 2 ranks from a 3-rank save: state identical to an uninterrupted run"
if "${mpi[@]}" -np 3 "$job" --root "$work/ckpt" --load --steps-from 3 --steps-to 4 --save 4 \
    --kill-rank 1 > "$work/killed.log" 2>&1; then
  echo "the job whose rank 1 was killed reported success"; cat "$work/killed.log"; exit 1
fi
"$tool" verify "$work/ckpt" --all
"$tool" inspect "$work/ckpt" --json > "$work/inspect.json"
grep -q '"latest": 3,' "$work/inspect.json"
if ls "$work/ckpt" | grep -q '^step-00000004'; then echo "step 4 was committed"; exit 1; fi
echo "mpi OK"
