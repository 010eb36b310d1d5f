#!/usr/bin/env bash
# The GPU path, checked in one call on a GPU host with the README's install plus the dev extra
# (pip install -e '.[dev]'), or with DALI on PYTHONPATH and this checkout as the package.
#
#   bash gpu_check/gpu_check.sh            # the default run: fits 8 minutes on one GPU (sum of limits <= 480 s)
#   bash gpu_check/gpu_check.sh --full     # the default run, then the long steps (whole suite, kill/resume, benches)
#   bash gpu_check/gpu_check.sh --dry-run  # print the steps, each one's time limit and their sum; run nothing
#
# First the preflight (step 0): torch, nvidia.dali and nvidia.nvimgcodec must import and torch must see a
# GPU, or the run stops in one line; it also gives the summary's header (GPU, torch and its CUDA, DALI,
# nvImageCodec, nvJPEG, TorchIterator's JPEG decoder). Then the default run, in order:
#  - the data: photographs made on the host (else synthetic images), about 10 % of them re-encoded as
#    progressive, 4:4:4, gray, 2-6 MP or EXIF-rotated;
#  - doctor --json (its crop-window probe runs in a child) and the decode differences in pixel levels,
#    the GPU's eval output against the CPU's over 1,024 images with the worst named (fails on a GPU image
#    off the CPU's or flat);
#  - the odd-JPEG corpus (ODD_JPEGS) decoded by `mixed` and compared with the CPU per kind, within the bound
#    its manifest states;
#  - the failure paths (float16 with random erasing, a real DALI out-of-memory provoked every time);
#  - the loader's ceiling: DALIIterator at 8 and 16 threads and at hw_decoder_load 0.65 and 0.99, each
#    beside the plain-DALI whole-image pipeline on the same images, TorchIterator with 16 workers; per row
#    a timed window of 3 s or more after a warm-up, batch times p50/p99/max and the JPEG engine's use; the
#    engine verdict (the step fails when a present engine stays idle) and ceiling.json are written before
#    the plain-DALI crop-window rows, which run in a process of their own;
#  - ResNet-50 and ResNet-18 (bf16, channels_last) fed by DALIIterator against a batch resident on the GPU;
#  - the controller over three epochs after a forced shrink;
#  - the gpu-marked tests (only the files that have some: collecting the whole suite took most of the time);
#  - the answers, which end summary.md: DALIIterator over the best plain DALI, each model over its resident
#    ceiling, the engine's use, the load that wins on p99, corruption found or not, the crop-window probe.
#
# Every step runs under `timeout` with its limit, even when one before it failed. As each step ends, its
# status and the figures it printed ("FIGURE <key> <value>" lines) are appended to $OUT/summary.md and its
# log added to $OUT/logs.tar.gz, so a run cut short still leaves both. $OUT holds only these two files; the
# data, logs and caches are made in $GPU_CHECK_WORK. The exit status is non-zero when a step failed or
# timed out.
#
# Environment: OUT (results; default ./gpu-results), GPU_CHECK_WORK (working folder; default a new one in
# $TMPDIR or /tmp), PYTHON (default python3), ODD_JPEGS (the odd-JPEG corpus; default
# tests/fixtures/odd_jpegs); for tests of this script, GPU_CHECK_STEPS (a file of "name|limit seconds|command"
# lines that replaces the steps) and GPU_CHECK_REQUIRE_GPU=0 (run without a GPU).
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
CORPUS="${ODD_JPEGS:-$PWD/tests/fixtures/odd_jpegs}"
PREFLIGHT_LIMIT=30
PREFLIGHT="$PY gpu_check/gpu_preflight.py"

# name|limit in seconds|command. No step has been timed on a GPU in this form: the limits are estimates
# with room, the ceiling and models steps' from their rows' windows (3 s each after a warm-up); the gpu
# tests timed out at 80 s with 76 s of tests before, so they get 120 s.
DEFAULT_STEPS=(
  "data|30|$STEP data --out $WORK/data --images 4096 --size 500x375 --quality 95 --odd-share 0.1"
  "doctor and decode|45|$PY -m dali_fast doctor --json > $WORK/doctor.json; d=\$?; $STEP decode --doctor-json $WORK/doctor.json --data $DATA --out $WORK --images 64 --eval-images 1024 && exit \$d"
  "odd jpegs|20|$STEP odd --corpus $CORPUS --out $WORK"
  "failure paths|30|$STEP failures --data $DATA --out $WORK"
  "loader ceiling|100|$STEP ceiling --data $DATA --out $WORK --threads 8,16 --loads 0.65,0.99 --workers 16 --min-seconds 3"
  "models|75|$STEP models --data $DATA --out $WORK --models resnet50,resnet18 --min-seconds 3"
  "controller|20|$STEP controller --data $DATA --out $WORK"
  "gpu tests|120|$PY -m pytest -q -m gpu -p no:cacheprovider --durations=8 \$(grep -rl --include='test_*.py' 'mark.gpu' tests)"
)
ANSWERS_STEP="answers|10|$STEP answers --out $WORK"
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
  STEPS=("${DEFAULT_STEPS[@]}" "${FULL_STEPS[@]}" "$ANSWERS_STEP")
else
  STEPS=("${DEFAULT_STEPS[@]}" "$ANSWERS_STEP")
fi

if [ "$DRY" = 1 ]; then
  total=$PREFLIGHT_LIMIT
  echo "gpu_check.sh --dry-run: the $MODE run, results under $OUT, work in $WORK"
  printf '  %2d. %-18s %5s s  %s\n' 0 preflight "$PREFLIGHT_LIMIT" "$PREFLIGHT"
  for i in "${!STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
    printf '  %2d. %-18s %5s s  %s\n' "$((i + 1))" "$name" "$limit" "$cmd"
    total=$((total + limit))
  done
  echo "total of limits: $total s"
  exit 0
fi

# The preflight: one line and exit 1 when torch, DALI or nvImageCodec does not import or no GPU is seen.
flags=()
[ "${GPU_CHECK_REQUIRE_GPU:-1}" = 0 ] && flags=(--no-gpu-needed)
info=$(timeout --kill-after=5 "$PREFLIGHT_LIMIT" $PREFLIGHT "${flags[@]}" 2>&1)
rc=$?
if [ $rc -ne 0 ]; then
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then info="the preflight took more than $PREFLIGHT_LIMIT s"; fi
  echo "no usable GPU: $(echo "$info" | tail -n 1)"
  exit 1
fi

mkdir -p "$OUT" "$WORK"
SUMMARY="$OUT/summary.md"
# summary.md is replaced whole at each update (a copy plus the new section, then a rename), so a reader,
# or a host taken back mid-run, never sees half a section.
add_to_summary() { cat "$SUMMARY" - > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"; }
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
# The table of every step (and the benches' tables in a full run); in a default or full run the answers
# come after it, as summary.md's last section.
all_steps() {
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
  echo
}
tabled=0
for i in "${!STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
  if [ "$name" = answers ]; then all_steps | add_to_summary; tabled=1; fi
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
[ $tabled = 1 ] || all_steps | add_to_summary
cat "$SUMMARY"
exit $failed
