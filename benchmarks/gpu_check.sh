#!/usr/bin/env bash
# The GPU path, proved in one call on a GPU host with the README's install plus the dev extra
# (pip install -e '.[dev]'), or with DALI on PYTHONPATH and this checkout as the package.
#
#   bash benchmarks/gpu_check.sh            # run every step; results and summary.md under $OUT
#   bash benchmarks/gpu_check.sh --dry-run  # print the steps, run nothing
#
# Steps: doctor --json; the gpu-marked tests; the whole suite; train on the GPU, SIGKILL after the
# first checkpoint, --resume; bench --model none and --model resnet50 --controller (all loaders side by
# side, AMP on the GPU); bench --stages --model resnet50; the recipes side by side (automatic augmentation,
# erasing and mixup/cutmix on the GPU); with 2+ GPUs a torchrun (nccl) run. Every step runs even when one fails; summary.md
# lists each step's status and figures, and the exit status is non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DALI_FAST_CACHE="${DALI_FAST_CACHE:-$OUT/cache}"
CK="$OUT/ckpt"

STEPS=(
  "doctor|$PY -m dali_fast doctor --json > $OUT/doctor.json; $PY -m dali_fast doctor"
  "gpu tests|$PY -m pytest -q -m gpu tests -p no:cacheprovider"
  "whole suite|$PY -m pytest -q tests -p no:cacheprovider"
  "sigkill + resume|bash $PWD/benchmarks/gpu_kill_resume.sh $CK"
  "bench none|$PY -m dali_fast bench --images 4000 --epochs 2 --batch-size 256 --model none --out $OUT/none"
  "bench resnet50|$PY -m dali_fast bench --images 4000 --epochs 2 --batch-size 128 --model resnet50 --controller --out $OUT/resnet50"
  "bench stages|$PY -m dali_fast bench --stages --images 4000 --epochs 2 --batch-size 128 --model resnet50 --out $OUT/stages"
  "bench recipes|$PY -m dali_fast bench --images 4000 --epochs 2 --batch-size 256 --model none --loaders torch,dali --augment none,randaugment,trivialaugment,autoaugment --random-erasing 0.25 --mixup 0.8 --cutmix 1.0 --out $OUT/recipes"
  "torchrun 2 GPUs|$PY -m torch.distributed.run --standalone --nproc_per_node=2 -m dali_fast train --images 2000 --loader dali --epochs 2 --model resnet18 --batch-size 128 --checkpoint $OUT/ddp-ckpt --out $OUT/ddp"
)

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh would run (results under $OUT):"
  for s in "${STEPS[@]}"; do echo "  ${s%%|*}: ${s#*|}"; done
fi

why=$("$PY" - <<'EOF' 2>&1
try:
    import torch
except Exception as e:
    print(f"torch does not import ({e})")
else:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print(f"torch {torch.__version__} sees no CUDA device")
EOF
)
if [ -n "$why" ]; then
  echo "no usable GPU: $why"
  exit "$((1 - DRY))"
fi
[ "$DRY" = 1 ] && exit 0

mkdir -p "$OUT"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
SUMMARY="$OUT/summary.md"
{
  echo "# gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo
  "$PY" -c 'import torch; print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")'
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---:|"
} > "$SUMMARY"
failed=0
for s in "${STEPS[@]}"; do
  name="${s%%|*}"; cmd="${s#*|}"
  if [ "$name" = "torchrun 2 GPUs" ] && [ "$GPUS" -lt 2 ]; then
    echo "| $name | skipped: $GPUS GPU on this host | |" >> "$SUMMARY"; continue
  fi
  echo "== $name: $cmd"
  t0=$(date +%s)
  bash -c "$cmd" > "$OUT/${name// /_}.log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  tail -n 5 "$OUT/${name// /_}.log"
  if [ $rc -eq 0 ]; then status=ok; else status="FAILED (exit $rc, see ${name// /_}.log)"; failed=1; fi
  echo "| $name | $status | $dt |" >> "$SUMMARY"
done
{
  echo
  if [ -f "$OUT/stages/stages.json" ]; then
    echo "## bench --stages --model resnet50"
    echo
    "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/stages/stages.json"
    echo
  fi
  for b in none resnet50 recipes; do
    if [ -f "$OUT/$b/results.json" ]; then
      echo "## bench: $b"
      echo
      "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/$b/results.json"
      echo
    fi
  done
  if [ -f "$OUT/doctor.json" ]; then
    echo "## doctor"
    echo
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print('problem:', r['problem']); print('gpu decode:', r['readings']['gpu_decode']); print('hw decoder:', r['readings']['hw_decoder']); print('decoder preallocation:', r['readings']['decoder_preallocation'])" "$OUT/doctor.json"
  fi
  for f in sigkill_+_resume whole_suite gpu_tests; do
    [ -f "$OUT/$f.log" ] && { echo; echo "## $f (last lines)"; echo; echo '```'; tail -n 8 "$OUT/$f.log"; echo '```'; }
  done
} >> "$SUMMARY"
cat "$SUMMARY"
exit $failed
