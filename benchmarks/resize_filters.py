"""Resize filters side by side: time per crop and pixel differences against Pillow's bilinear and DALI's.

    python benchmarks/resize_filters.py DATASET [--images 100] [--sizes 224,112] [--crops 3] [--seed 0]

Each image of DATASET (an ImageFolder or a packed set) is decoded once; ``--crops`` random-resized-crop
boxes are drawn per image (the loaders' own `random_resized_crop_box`) and each box is resized to each
of ``--sizes`` by every filter:

- ``TorchIterator bilinear``: what `TorchIterator` uses (`dali_fast.transforms.resize.resize`, crop then
  resize): plain bilinear (torch's non-antialiased uint8 kernel) on shrinks under 2x, torch's antialiased
  kernel on the others;
- ``torch AA bilinear``: torch's antialiased uint8 kernel alone (Pillow's filter on every crop);
- ``Pillow bilinear (box)``: ``Image.resize(size, BILINEAR, box=...)``, the baseline's transform;
- ``Pillow bilinear (crop)``: ``Image.crop(box).resize(...)``, torchvision's ``resized_crop`` on a PIL image;
- ``DALI linear``: ``fn.resize`` of the box's crop (antialiased on shrinks, its default), as DALIIterator
  resizes the window its decoder cropped (when nvidia-dali is installed);
- ``cv2 INTER_LINEAR`` / ``cv2 INTER_AREA``: OpenCV's (when opencv-python-headless is installed).

Reported: ms per crop on one core (median of three passes after a warm-up, the filters taking turns),
and the mean absolute difference in levels (0-255) against Pillow's bilinear (box) and against DALI's,
with the largest single difference in parentheses. At 224 px these ~470x370 photos are mostly shrunk 1-2x; at 112 px, 2-4x, where a
filter without antialiasing shows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from PIL import Image

from dali_fast.data.open import open_dataset
from dali_fast.transforms.decode import decode_rgb
from dali_fast.transforms.resize import random_resized_crop_box, resize


def torch_aa(crop: np.ndarray, size: int) -> np.ndarray:
    """torch's antialiased bilinear uint8 kernel on every crop (Pillow's filter)."""
    out = torch.empty((size, size, 3), dtype=torch.uint8)
    x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).unsqueeze(0)
    torch.ops.aten._upsample_bilinear2d_aa.out(
        x, [size, size], False, None, None, out=out.permute(2, 0, 1).unsqueeze(0)
    )
    return out.numpy()


def filters(size: int) -> dict:
    """name -> f(rgb array, PIL image, (x0, y0, x1, y1)) -> uint8 (size, size, 3)."""
    out = {
        "TorchIterator bilinear": lambda a, im, b: resize(a[b[1] : b[3], b[0] : b[2]], (size, size)).numpy(),
        "torch AA bilinear": lambda a, im, b: torch_aa(a[b[1] : b[3], b[0] : b[2]], size),
        "Pillow bilinear (box)": lambda a, im, b: np.asarray(im.resize((size, size), Image.BILINEAR, box=b)),
        "Pillow bilinear (crop)": lambda a, im, b: np.asarray(im.crop(b).resize((size, size), Image.BILINEAR)),
    }
    try:
        import cv2

        cv2.setNumThreads(1)
        for name, flag in (("cv2 INTER_LINEAR", cv2.INTER_LINEAR), ("cv2 INTER_AREA", cv2.INTER_AREA)):
            out[name] = lambda a, im, b, flag=flag: cv2.resize(
                a[b[1] : b[3], b[0] : b[2]], (size, size), interpolation=flag
            )
    except ImportError:
        pass
    return out


def dali_resize(images: list[np.ndarray], boxes: list[tuple[int, int, int, int]], size: int) -> list[np.ndarray] | None:
    """DALI's linear resize of each box's crop, on the CPU, as DALIIterator resizes the window its decoder
    cropped; None without DALI."""
    try:
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types
        from nvidia.dali import pipeline_def
    except ImportError:
        return None
    out: list[np.ndarray] = []
    for start in range(0, len(images), 16):
        imgs, bx = images[start : start + 16], boxes[start : start + 16]

        @pipeline_def(batch_size=len(imgs), num_threads=1, device_id=None)
        def pipe(imgs=imgs, bx=bx):
            crops = [np.ascontiguousarray(x[b[1] : b[3], b[0] : b[2]]) for x, b in zip(imgs, bx, strict=True)]
            im = fn.external_source(source=lambda: crops, batch=True, layout="HWC")
            return fn.resize(im, size=[size, size], interp_type=types.INTERP_LINEAR)

        p = pipe()
        p.build()
        (res,) = p.run()
        out += [np.asarray(res[i]) for i in range(len(imgs))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--sizes", default="224,112")
    ap.add_argument("--crops", type=int, default=3, help="random-resized-crop boxes per image")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    reader = open_dataset(a.dataset)
    rng = np.random.default_rng(a.seed)
    picks = rng.choice(len(reader), size=min(a.images, len(reader)), replace=False)
    arrays, pils, boxes = [], [], []
    for i in picks:
        rgb = decode_rgb(reader[int(i)][0])
        for _ in range(a.crops):
            left, top, w, h = random_resized_crop_box(rng, rgb.shape[1], rgb.shape[0])
            arrays.append(rgb)
            pils.append(Image.fromarray(rgb))
            boxes.append((left, top, left + w, top + h))
    sizes = [int(s) for s in a.sizes.split(",")]
    results: dict[str, dict] = {}
    for size in sizes:
        dali = dali_resize(arrays, boxes, size)
        box_resize = filters(size)["Pillow bilinear (box)"]
        ref = [box_resize(x, im, b) for x, im, b in zip(arrays, pils, boxes, strict=True)]
        fs = filters(size)
        times: dict[str, list[float]] = {name: [] for name in fs}
        outs: dict[str, list[np.ndarray]] = {}
        for rep in range(4):  # the filters take turns, so a change of machine load slows each alike
            for name, f in fs.items():
                t0 = time.perf_counter()
                got = [f(x, im, b) for x, im, b in zip(arrays, pils, boxes, strict=True)]
                if rep:  # the first pass warms up
                    times[name].append((time.perf_counter() - t0) / len(boxes))
                else:
                    outs[name] = got
        for name in fs:
            entry = results.setdefault(name, {})
            entry[f"ms@{size}"] = 1e3 * float(np.median(times[name]))
            entry[f"pillow@{size}"] = diff(outs[name], ref)
            entry[f"dali@{size}"] = diff(outs[name], dali) if dali is not None else None
        if dali is not None:
            entry = results.setdefault("DALI linear", {})
            entry[f"ms@{size}"] = None
            entry[f"pillow@{size}"] = diff(dali, ref)
            entry[f"dali@{size}"] = (0.0, 0)
    print(f"{len(boxes)} random-resized crops of {len(picks)} images of {a.dataset}; levels 0-255, mean (max)\n")
    head = "| filter | " + " | ".join(f"ms per crop @{s}" for s in sizes)
    head += " | " + " | ".join(f"vs Pillow bilinear @{s}" for s in sizes)
    head += " | " + " | ".join(f"vs DALI @{s}" for s in sizes) + " |"
    print(head)
    print("|---|" + "---:|" * (3 * len(sizes)))
    for name, e in results.items():
        cells = [("-" if e[f"ms@{s}"] is None else f"{e[f'ms@{s}']:.3f}") for s in sizes]
        cells += [fmt(e[f"pillow@{s}"]) for s in sizes] + [fmt(e[f"dali@{s}"]) for s in sizes]
        print(f"| {name} | " + " | ".join(cells) + " |")


def diff(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, int]:
    d = [np.abs(x.astype(np.int32) - y.astype(np.int32)) for x, y in zip(a, b, strict=True)]
    return float(np.mean([x.mean() for x in d])), int(max(x.max() for x in d))


def fmt(v: tuple[float, int] | None) -> str:
    return "-" if v is None else f"{v[0]:.2f} ({v[1]})"


if __name__ == "__main__":
    main()
