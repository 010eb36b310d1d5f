"""``bench``'s FFCV row: the same data, crop, flip, normalize, batch, size and workers through FFCV's `Loader`,
its ``.beton`` written once into the cache, where FFCV is installed (an anchor to read the other rows by).

`ffcv_spec` translates a `Recipe` into FFCV's pipelines as plain data (names and arguments, testable
without FFCV); `ffcv_row` writes or reuses the ``.beton`` and builds the row. FFCV resizes with
OpenCV's INTER_AREA and decodes the crop's JPEG whole, as it does for its own users.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.base import Reader, fingerprint, read_checked
from ..files import cache_folder, clean_stale
from ..transforms.decode import decode_rgb
from ..transforms.recipe import Recipe

log = logging.getLogger(__name__)

FFCV = "ffcv"
FFCV_HINT = (
    "the ffcv row needs FFCV: pip install ffcv (it builds against libjpeg-turbo and OpenCV: apt-get install "
    "libturbojpeg0-dev libopencv-dev pkg-config first), or leave ffcv out of --loaders"
)
BETON_WRITE = {"write_mode": "jpg", "jpeg_quality": 90}  # FFCV's JPEG mode: each image re-encoded at q90


def ffcv_missing() -> str | None:
    """None when FFCV can be imported here, else the one line that says how to get it."""
    return None if importlib.util.find_spec("ffcv") is not None else FFCV_HINT


def check_crop_flip_only(recipe: Recipe, row: str) -> None:
    """A one-line ValueError for the settings a peer's row (FFCV's, SPDL's) has no operation for: those
    rows run a random-resized crop, a flip and normalization, bilinear, and nothing else."""
    unsupported = [
        name
        for name, on in (
            ("auto_augment", recipe.auto_augment is not None),
            ("random_erasing", recipe.random_erasing > 0),
            ("resolution (progressive resizing)", recipe.resolution is not None),
            (f"interpolation={recipe.interpolation!r}", recipe.interpolation != "bilinear"),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"the {row} row runs crop, flip and normalize only, not {', '.join(unsupported)}; "
            f"leave {row} out of --loaders or drop those settings"
        )


def ffcv_spec(recipe: Recipe) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """The FFCV pipelines that do what ``recipe`` does in training, as (operation name, arguments) per field.

    Random-resized crop at the recipe's scale and ratio, horizontal flip at its probability, then
    normalization by its mean and std (0-255 scale, before `ToTorchImage`: FFCV hangs the other way round)
    into float32 or float16, or none for uint8 output; NCHW contiguous or channels_last as the recipe says.
    Settings FFCV has no operation for are a one-line ValueError.
    """
    check_crop_flip_only(recipe, "ffcv")
    S = recipe.image_size
    image: list[tuple[str, dict[str, Any]]] = [
        ("RandomResizedCropRGBImageDecoder", {"output_size": (S, S), "scale": recipe.scale, "ratio": recipe.ratio}),
        ("RandomHorizontalFlip", {"flip_prob": recipe.hflip}),
    ]
    if recipe.normalize:
        dtype = "float16" if recipe.out_dtype == torch.float16 else "float32"
        image.append(("NormalizeImage", {"mean": recipe.mean_255, "std": recipe.std_255, "type": dtype}))
    channels_last = recipe.memory_format == torch.channels_last
    image += [("ToTensor", {}), ("ToTorchImage", {"channels_last": channels_last, "convert_back_int16": False})]
    return {"image": image, "label": [("IntDecoder", {}), ("ToTensor", {}), ("Squeeze", {})]}


def build_pipelines(spec: dict[str, list[tuple[str, dict[str, Any]]]]) -> dict[str, list[Any]]:
    """`ffcv_spec`'s pipelines as FFCV operations (needs FFCV)."""
    from ffcv import fields, transforms
    from ffcv.fields import decoders

    def make(name: str, kwargs: dict[str, Any]) -> Any:
        kw = dict(kwargs)
        if name == "NormalizeImage":
            kw = {"mean": np.array(kw["mean"]), "std": np.array(kw["std"]), "type": np.dtype(kw["type"]).type}
        for home in (decoders, fields, transforms):
            if hasattr(home, name):
                return getattr(home, name)(**kw)
        raise ValueError(f"FFCV has no operation {name!r}: this FFCV is not the one the row was written for")

    return {field: [make(name, kw) for name, kw in ops] for field, ops in spec.items()}


def beton_key(reader: Reader) -> str:
    """What names a data set's ``.beton``: its fingerprint, every record's source and the write settings."""
    h = hashlib.sha256(json.dumps({"data": fingerprint(reader), "write": BETON_WRITE}, sort_keys=True).encode())
    for i in range(len(reader)):
        h.update(str(reader.source(i)).encode() + b"\0")
    return h.hexdigest()[:24]


class _Decoded:
    """The reader as FFCV's writer takes it: (HWC uint8 RGB by the shared decoding rule, label); a bad
    record is a one-line error (the row compares loaders on clean data)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        data, label, reason = read_checked(self.reader, i)
        if reason is not None:
            raise ValueError(f"record {i} ({self.reader.source(i)}): {reason}; the ffcv row needs every record good")
        return decode_rgb(data), int(label)


def write_beton(reader: Reader, workers: int) -> Path:
    """The data set's ``.beton`` under ``$DALI_FAST_CACHE/ffcv``: reused when there, else written (atomically:
    a killed write leaves nothing that a later run would read)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    path = cache_folder(FFCV) / f"{beton_key(reader)}.beton"
    if path.exists():
        log.info("ffcv row: reusing %s", path)
        return path
    clean_stale(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    log.info("ffcv row: writing %s (once per data set)", path)
    try:
        fields = {"image": RGBImageField(**BETON_WRITE), "label": IntField()}
        DatasetWriter(str(tmp), fields, num_workers=max(1, workers)).from_indexed_dataset(_Decoded(reader))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class FFCVLoader:
    """FFCV's `Loader` over the ``.beton`` as a bench row sees a loader: iterate an epoch, `close`."""

    def __init__(self, path: Path, batch_size: int, workers: int, recipe: Recipe, seed: int = 0) -> None:
        from ffcv.loader import Loader, OrderOption

        self.loader = Loader(
            str(path),
            batch_size=batch_size,
            num_workers=max(1, workers),
            order=OrderOption.RANDOM,
            seed=seed,
            drop_last=False,
            os_cache=True,
            pipelines=build_pipelines(ffcv_spec(recipe)),
        )

    def __iter__(self) -> Any:
        for images, labels in self.loader:
            yield images, labels.long()  # int64 labels, as the other rows give

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        self.loader = None  # its threads end with their epoch
