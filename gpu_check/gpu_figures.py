"""What every gpu_check measuring step shares: its figures (each printed at once as ``FIGURE <key> <value>``,
kept for ``<step>.json``), why it fails, and how it reads the device it runs on (CUDA, NVML)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

FIGURES: dict[str, Any] = {}
FAILED: list[str] = []  # why the step fails (its figures are all printed first); empty: it passed


def figure(key: str, value: Any) -> None:
    """Print one figure at once (a step stopped at its time limit keeps what it printed) and keep it."""
    if isinstance(value, float):
        value = round(value, 4 if abs(value) < 10 else 1)
    FIGURES[key] = value
    text = str(value).replace("\n", " ").replace("|", "/")
    print(f"FIGURE {key} {text}", flush=True)


def save(out: Path, step: str) -> None:
    """Write the figures so far to ``out/<step>.json`` (again at the step's end): a later crash keeps them."""
    (out / f"{step}.json").write_text(json.dumps(FIGURES, indent=1, default=str))


def gpu_wanted(args: argparse.Namespace) -> bool:
    if args.device == "cpu":
        return False
    usable = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not usable:
        sys.exit("--device cuda but CUDA is not usable here")
    return usable


def device_name(gpu: bool) -> str:
    return "cuda" if gpu else "cpu"


def open_nvml(gpu: bool) -> tuple[Any, Any]:
    """(pynvml, handle of this process's CUDA device), or (None, None) where NVML cannot be read."""
    if not gpu:
        return None, None
    try:
        import pynvml

        from dali_fast.machine import nvml_handle

        pynvml.nvmlInit()
        return pynvml, nvml_handle(pynvml, torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001 - NVML missing: those figures read n/a
        print(f"NVML cannot be read: {e}", flush=True)
        return None, None


def gib(n: float | None) -> Any:
    return round(n / 2**30, 2) if isinstance(n, int | float) else "n/a"
