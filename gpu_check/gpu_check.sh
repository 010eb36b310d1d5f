#!/usr/bin/env bash
# The GPU path, checked in one call on a GPU host with the README's install plus the dev extra
# (pip install -e '.[dev]'), or with DALI on PYTHONPATH and this checkout as the package.
#
#   bash gpu_check/gpu_check.sh            # the default run: fits 8 minutes on one GPU (sum of limits <= 480 s)
#   bash gpu_check/gpu_check.sh --full     # the default run, then the long steps (whole suite, kill/resume, benches)
#   bash gpu_check/gpu_check.sh --dry-run  # print the steps, each one's time limit and their sum; run nothing
#
# The default run, in order: the data (photographs made on the host, else synthetic images); doctor --json
# and the GPU-vs-CPU decode differences in pixel levels; the failure paths (float16 with random erasing, a
# real DALI out-of-memory provoked every time); the loader's ceiling (DALIIterator img/s at 8 and 16 threads
# beside the plain-DALI reference pipelines on the same images, the share of each step spent in the
# external-source callback, the JPEG engine's utilization, which fails the step when the engine stays idle,
# TorchIterator with 16 workers); ResNet-50 and ResNet-18 in bf16, channels_last, fed by DALI against a
# batch already on the GPU; the controller over three epochs after a forced shrink; the gpu-marked tests
# (only the files that have some: collecting the whole suite took most of that step's time).
#
# Every step runs under `timeout` with its limit, even when one before it failed. As each step ends, its
# status and the figures it printed ("FIGURE <key> <value>" lines) are appended to $OUT/summary.md and its
# log added to $OUT/logs.tar.gz, so a run cut short still leaves both. $OUT holds only these two files; the
# data, logs and caches are made in $GPU_CHECK_WORK. The exit status is non-zero when a step failed or
# timed out.
#
# Environment: OUT (results; default ./gpu-results), GPU_CHECK_WORK (working folder; default a new one in
# $TMPDIR or /tmp), PYTHON (default python3); for tests of this script, GPU_CHECK_STEPS (a file of
# "name|limit seconds|command" lines that replaces the steps) and GPU_CHECK_REQUIRE_GPU=0 (run without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=default
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --full) MODE=full ;;
    *) echo "unknown argument $a: use --dry-run and/or --full" >&2; exit 2 ;;
  esac
done
DRY="${DRY:-0}"
OUT="${OUT:-$PWD/gpu-results}"
WORK="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check.$$}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export DALI_FAST_CACHE="${DALI_FAST_CACHE:-$WORK/cache}"
STEP="$PY gpu_check/gpu_steps.py"
DATA="$WORK/data/packed"

# name|limit in seconds|command
DEFAULT_STEPS=(
  "data|40|$STEP data --out $WORK/data --images 4096 --size 500x375 --quality 95"
  "doctor and decode|45|$PY -m dali_fast doctor --json > $WORK/doctor.json; d=\$?; $STEP decode --doctor-json $WORK/doctor.json --data $DATA --out $WORK --images 128 && exit \$d"
  "failure paths|40|$STEP failures --data $DATA --out $WORK"
  "loader ceiling|110|$STEP ceiling --data $DATA --out $WORK --threads 8,16 --workers 16 --epochs 2"
  "models|125|$STEP models --data $DATA --out $WORK --models resnet50,resnet18 --epochs 2"
  "controller|30|$STEP controller --data $DATA --out $WORK"
  "gpu tests|90|$PY -m pytest -q -m gpu -p no:cacheprovider --durations=8 \$(grep -rl --include='test_*.py' 'mark.gpu' tests)"
)
FULL_STEPS=(
  "whole suite|1200|$PY -m pytest -q tests -p no:cacheprovider"
  "sigkill + resume|300|bash $PWD/gpu_check/gpu_kill_resume.sh $WORK/ckpt"
  "bench none|300|$PY -m dali_fast bench --images 4000 --epochs 2 --batch-size 256 --model none --out $WORK/none"
  "bench resnet50|600|$PY -m dali_fast bench --images 4000 --epochs 2 --batch-size 128 --model resnet50 --controller --out $WORK/resnet50"
  "bench stages|600|$PY -m dali_fast stages --images 4000 --epochs 2 --batch-size 128 --model resnet50 --out $WORK/stages"
  "bench recipes|600|$PY -m dali_fast bench --images 4000 --epochs 2 --batch-size 256 --model none --loaders torch,dali --augment none,randaugment,trivialaugment,autoaugment --random-erasing 0.25 --mixup 0.8 --cutmix 1.0 --out $WORK/recipes"
  "progressive resnet50|600|$PY benchmarks/progressive.py --images 2048 --batch-size 128 --model resnet50 --repeats 1 --epochs 6 --ramp 160:224:1:4 --json $WORK/progressive.json"
  "torchrun 2 GPUs|300|$PY -m torch.distributed.run --standalone --nproc_per_node=2 -m dali_fast train --images 2000 --loader dali --epochs 2 --model resnet18 --batch-size 128 --checkpoint $WORK/ddp-ckpt --out $WORK/ddp"
)
if [ -n "${GPU_CHECK_STEPS:-}" ]; then
  mapfile -t STEPS < <(grep -v '^[[:space:]]*\(#\|$\)' "$GPU_CHECK_STEPS")
elif [ "$MODE" = full ]; then
  STEPS=("${DEFAULT_STEPS[@]}" "${FULL_STEPS[@]}")
else
  STEPS=("${DEFAULT_STEPS[@]}")
fi

if [ "$DRY" = 1 ]; then
  total=0
  echo "gpu_check.sh --dry-run: the $MODE run, results under $OUT, work in $WORK"
  for i in "${!STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
    printf '  %2d. %-18s %5s s  %s\n' "$((i + 1))" "$name" "$limit" "$cmd"
    total=$((total + limit))
  done
  echo "total of limits: $total s"
  exit 0
fi

if [ "${GPU_CHECK_REQUIRE_GPU:-1}" != 0 ]; then
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
    exit 1
  fi
fi

mkdir -p "$OUT" "$WORK"
SUMMARY="$OUT/summary.md"
# summary.md is replaced whole at each update (a copy plus the new section, then a rename), so a reader,
# or a host taken back mid-run, never sees half a section.
add_to_summary() { cat "$SUMMARY" - > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"; }
info=$("$PY" - <<'EOF' 2>&1
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpu = f"{n} x {torch.cuda.get_device_name(0)}" if n else "no GPU"
try:
    import nvidia.dali as dali
    d = dali.__version__
except Exception as e:  # noqa: BLE001
    d = f"not importable ({type(e).__name__})"
print(n)
print(f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); DALI {d}")
EOF
)
GPUS=$(echo "$info" | head -n 1)
[[ "$GPUS" =~ ^[0-9]+$ ]] || GPUS=0
{
  echo "# gpu_check ($MODE run): $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo
  echo "$info" | tail -n +2
  echo
} > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
failed=0
results=()
for i in "${!STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
  log="$WORK/$((i + 1))_$(echo "$name" | tr -c 'A-Za-z0-9\n' '_').log"
  if [ "$name" = "torchrun 2 GPUs" ] && [ "$GPUS" -lt 2 ]; then
    status="skipped: $GPUS GPU on this host"; dt=0
  else
    echo "== $((i + 1)). $name (limit $limit s): $cmd"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$cmd" > "$log" 2>&1
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    tail -n 5 "$log"
    if [ $rc -eq 0 ]; then status=ok
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMED OUT at its limit of $limit s"; failed=1
    else status="FAILED (exit $rc)"; failed=1
    fi
  fi
  results+=("| $((i + 1)). $name | $status | $dt | $limit |")
  {
    echo "## $((i + 1)). $name: $status ($dt s of $limit s)"
    echo
    if [ -f "$log" ] && grep -q '^FIGURE ' "$log"; then
      echo "| figure | value |"
      echo "|---|---|"
      grep '^FIGURE ' "$log" | sed -E 's/^FIGURE ([^ ]+) ?(.*)$/| \1 | \2 |/'
      echo
    fi
    if [ "$status" != ok ] && [ -f "$log" ] && grep -qv '^FIGURE ' "$log"; then
      echo '```'
      grep -v '^FIGURE ' "$log" | tail -n 12
      echo '```'
      echo
    elif [ "$name" = "gpu tests" ] || [ "$name" = "whole suite" ] || [ "$name" = "sigkill + resume" ]; then
      echo '```'
      tail -n 4 "$log"
      echo '```'
      echo
    fi
  } | add_to_summary
  (cd "$WORK" && tar czf "$OUT/.logs.tar.gz" -- ./*.log $(ls ./*.json 2>/dev/null) 2>/dev/null \
    && mv "$OUT/.logs.tar.gz" "$OUT/logs.tar.gz")
done
{
  echo "## all steps"
  echo
  echo "| step | status | seconds | limit |"
  echo "|---|---|---:|---:|"
  printf '%s\n' "${results[@]}"
  for b in stages none resnet50 recipes; do
    f="$WORK/$b/results.json"
    [ "$b" = stages ] && f="$WORK/stages/stages.json"
    if [ -f "$f" ]; then
      echo
      echo "## bench: $b"
      echo
      "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['table'])" "$f"
    fi
  done
} | add_to_summary
cat "$SUMMARY"
exit $failed
