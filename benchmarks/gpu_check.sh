#!/usr/bin/env bash
# One script for a GPU host with torch installed but not this package (DALI may come from PYTHONPATH).
# Runs the GPU tests, then the three loaders side by side with a ResNet-50 training step.
# Results go to $OUT (or ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DALI_FAST_CACHE="${DALI_FAST_CACHE:-$OUT/cache}"
PY="${PYTHON:-python3}"
{
  echo "== dali-fast doctor"
  "$PY" -m dali_fast doctor
  "$PY" -m dali_fast doctor --json > "$OUT/doctor.json"
  echo "== pytest -m gpu"
  "$PY" -m pytest -q -m gpu tests -p no:cacheprovider
  echo "== pytest (all, on the GPU host)"
  "$PY" -m pytest -q -x tests -p no:cacheprovider --deselect tests/test_records.py::test_killed_pack_leaves_no_dst
  echo "== bench: pure loading"
  "$PY" -m dali_fast bench --images 4000 --epochs 2 --batch-size 256 --model none --out "$OUT/none"
  echo "== bench: resnet50 training step (AMP, channels_last)"
  "$PY" -m dali_fast bench --images 4000 --epochs 1 --batch-size 128 --model resnet50 --controller --out "$OUT/resnet50"
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== train under torchrun, 2 GPUs (nccl), checkpoint + resume"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m dali_fast train --images 2000 \
      --loader dali --epochs 2 --model resnet18 --batch-size 128 --checkpoint "$OUT/ckpt" --out "$OUT/ddp"
  fi
} 2>&1 | tee "$OUT/gpu_check.log"
