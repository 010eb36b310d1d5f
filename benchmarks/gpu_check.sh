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
  echo "== doctor-ish: versions"
  "$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import nvidia.dali as d
    print("dali", d.__version__)
except ImportError as e:
    print("dali missing:", e)
PYEOF
  echo "== pytest -m gpu"
  "$PY" -m pytest -q -m gpu tests -p no:cacheprovider
  echo "== pytest (all, on the GPU host)"
  "$PY" -m pytest -q -x tests -p no:cacheprovider --deselect tests/test_records.py::test_killed_pack_leaves_no_dst
  echo "== bench: pure loading"
  "$PY" -m dali_fast bench --images 4000 --epochs 2 --batch-size 256 --model none --out "$OUT/none"
  echo "== bench: resnet50 training step (AMP, channels_last)"
  "$PY" -m dali_fast bench --images 4000 --epochs 1 --batch-size 128 --model resnet50 --controller --out "$OUT/resnet50"
} 2>&1 | tee "$OUT/gpu_check.log"
