#!/usr/bin/env bash
# Train on the GPU, SIGKILL the run once its first mid-epoch checkpoint is on disk, then --resume,
# and check from the recorded indices that the epoch saw each sample exactly once over both runs.
#   bash gpu_check/gpu_kill_resume.sh CHECKPOINT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
CK="${1:?usage: gpu_kill_resume.sh CHECKPOINT_DIR}"
PY="${PYTHON:-python3}"
rm -rf "$CK" && mkdir -p "$CK"
# Sizes for a GPU; KILL_RESUME_ARGS replaces them (the CPU test of this script uses tiny ones).
read -r -a SIZES <<< "${KILL_RESUME_ARGS:---images 1200 --model resnet18 --image-size 128 --batch-size 64}"
ARGS=(train --loader dali --epochs 2 "${SIZES[@]}" --checkpoint "$CK" --checkpoint-every 4 --no-drop-last)
"$PY" -m dali_fast "${ARGS[@]}" --record-indices "$CK/before.jsonl" > "$CK/before.log" 2>&1 &
pid=$!
for _ in $(seq 1 6000); do
  [ -f "$CK/checkpoint.pt" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.05
done
if ! [ -f "$CK/checkpoint.pt" ]; then echo "no checkpoint was written"; tail -n 20 "$CK/before.log"; exit 1; fi
kill -9 "$pid"; wait "$pid" 2>/dev/null
echo "killed the run after its first checkpoint"
"$PY" -m dali_fast "${ARGS[@]}" --resume --record-indices "$CK/after.jsonl" > "$CK/after.log" 2>&1 || {
  echo "resume failed"; tail -n 20 "$CK/after.log"; exit 1; }
grep -m1 "resumed from" "$CK/after.log" || { echo "the second run did not resume"; exit 1; }
"$PY" - "$CK" <<'EOF'
import json, sys
from pathlib import Path
from dali_fast.train.checkpoint import load_checkpoint, read_index_records
ck = Path(sys.argv[1])
state = load_checkpoint(ck / "checkpoint.pt")
before, after = read_index_records(ck / "before.jsonl"), read_index_records(ck / "after.jsonl")
if not after:
    sys.exit("the kill came after the last step (nothing was left to resume): give the run more images")
cut = next(r["step"] for r in after)  # the first step of the resumed run
for epoch in sorted({r["epoch"] for r in before + after}):
    seen = [i for r in before if r["epoch"] == epoch and r["step"] < cut for i in r["indices"]]
    seen += [i for r in after if r["epoch"] == epoch for i in r["indices"]]
    dup = len(seen) - len(set(seen))
    print(f"epoch {epoch}: {len(seen)} samples over both runs, {dup} seen twice")
    if dup:
        sys.exit(1)
print("each sample of each epoch exactly once across the kill")
EOF
