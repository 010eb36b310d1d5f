"""The plain-DALI reference rows of gpu_check's loader-ceiling step: the pipelines a DALI user would write,
over the same images, for DALIIterator to be measured against on the same GPU.

- ``whole``: ``fn.readers.file`` → ``fn.decoders.image`` (the whole image; on a GPU with fancy chroma
  upsampling and ``hw_decoder_load=0.99``, so the hardware JPEG engine decodes) → ``fn.random_resized_crop``
  → ``fn.crop_mirror_normalize``: what DALIIterator's training graph does on a GPU with a JPEG engine;
- ``roi``: ``fn.readers.file`` → ``fn.decoders.image_random_crop`` (only the crop window, DALI's default
  upsampling) → ``fn.resize`` → ``fn.crop_mirror_normalize``: DALI's own ResNet example.

Both read through ``DALIGenericIterator`` with the reader's epoch size, the crop rule of the default recipe
(area 0.08-1, aspect ratio 3/4-4/3, 10 attempts), a coin-flip mirror and ImageNet's normalization.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

HW_DECODER_LOAD = 0.99
IMAGENET_MEAN_255 = [0.485 * 255, 0.456 * 255, 0.406 * 255]
IMAGENET_STD_255 = [0.229 * 255, 0.224 * 255, 0.225 * 255]
KINDS = ("whole", "roi")


def plain_pipeline(
    folder: Path, kind: str, *, batch_size: int, threads: int, size: int, gpu: bool, device_id: int | None = None
) -> Any:
    """The built pipeline of ``kind`` over the ImageFolder ``folder`` (its reader is named "files")."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {', '.join(KINDS)}")
    device = "mixed" if gpu else "cpu"
    crop = {"random_area": [0.08, 1.0], "random_aspect_ratio": [3 / 4, 4 / 3], "num_attempts": 10}

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=(device_id or 0) if gpu else None, seed=0)
    def pipe():  # type: ignore[no-untyped-def]
        jpegs, labels = fn.readers.file(file_root=str(folder), random_shuffle=True, name="files")
        if kind == "whole":
            fast = {"jpeg_fancy_upsampling": True, "hw_decoder_load": HW_DECODER_LOAD} if gpu else {}
            images = fn.decoders.image(jpegs, device=device, output_type=types.RGB, **fast)
            images = fn.random_resized_crop(images, size=[size, size], **crop)
        else:
            images = fn.decoders.image_random_crop(jpegs, device=device, output_type=types.RGB, **crop)
            images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=(size, size),
            mean=IMAGENET_MEAN_255,
            std=IMAGENET_STD_255,
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels.gpu() if gpu else labels

    p = pipe()
    p.build()
    return p


def plain_epochs(folder: Path, kind: str, **kw: Any) -> tuple[Callable[[], int], Callable[[], None]]:
    """(one epoch of the ``kind`` pipeline over ``folder``, returning its images; shut it down)."""
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    p = plain_pipeline(folder, kind, **kw)
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="files", last_batch_policy=LastBatchPolicy.PARTIAL)

    def epoch() -> int:
        n = sum(int(b[0]["labels"].shape[0]) for b in it)
        it.reset()
        return n

    def close() -> None:
        shutdown = getattr(p, "_shutdown", None)
        if shutdown is not None:
            shutdown()

    return epoch, close
