"""The plain-DALI reference rows of gpu_check's loader-ceiling step: the pipelines a DALI user would write,
over the same images, for DALIIterator to be measured against on the same GPU.

- ``whole``: ``fn.readers.file`` → ``fn.decoders.image`` (the whole image; on a GPU with fancy chroma
  upsampling and ``hw_decoder_load`` of the work on the hardware JPEG engine) → ``fn.random_resized_crop``
  → ``fn.crop_mirror_normalize``: what DALIIterator's training graph does on a GPU with a JPEG engine;
- ``roi``: ``fn.readers.file`` → ``fn.decoders.image_random_crop`` (only the crop window, DALI's default
  upsampling, ``hw_decoder_load`` on the engine) → ``fn.resize`` → ``fn.crop_mirror_normalize``: DALI's own
  ResNet example. nvImageCodec 0.9.0 crashes in this decoder on some GPUs (NVIDIA/nvImageCodec#55), so
  gpu_check runs these rows in a process of their own.

Both read through ``DALIGenericIterator`` with the reader's epoch size, the crop rule of the default recipe
(area 0.08-1, aspect ratio 3/4-4/3, 10 attempts), a coin-flip mirror and ImageNet's normalization. Rows
are run at each ``hw_decoder_load`` asked for: 0.65 (DALI's default) and 0.99 (this project's, for now).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

HW_DECODER_LOAD = 0.99  # unless a row asks for another
IMAGENET_MEAN_255 = [0.485 * 255, 0.456 * 255, 0.406 * 255]
IMAGENET_STD_255 = [0.229 * 255, 0.224 * 255, 0.225 * 255]
KINDS = ("whole", "roi")


def plain_pipeline(
    folder: Path,
    kind: str,
    *,
    batch_size: int,
    threads: int,
    size: int,
    gpu: bool,
    device_id: int | None = None,
    hw_load: float = HW_DECODER_LOAD,
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
            fast = {"jpeg_fancy_upsampling": True, "hw_decoder_load": hw_load} if gpu else {}
            images = fn.decoders.image(jpegs, device=device, output_type=types.RGB, **fast)
            images = fn.random_resized_crop(images, size=[size, size], **crop)
        else:
            load = {"hw_decoder_load": hw_load} if gpu else {}
            images = fn.decoders.image_random_crop(jpegs, device=device, output_type=types.RGB, **crop, **load)
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


def plain_epochs(folder: Path, kind: str, **kw: Any) -> tuple[Callable[[int, Any], None], Callable[[], None]]:
    """(one epoch of the ``kind`` pipeline over ``folder``, timed batch by batch into a `gpu_rows.BatchTimes`;
    shut it down). The epoch's number is not used: the reader shuffles by its own stream."""
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    p = plain_pipeline(folder, kind, **kw)
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="files", last_batch_policy=LastBatchPolicy.PARTIAL)

    def epoch(_number: int, times: Any) -> None:
        times.over(it, lambda batch: int(batch[0]["labels"].shape[0]))
        it.reset()

    def close() -> None:
        shutdown = getattr(p, "_shutdown", None)
        if shutdown is not None:
            shutdown()

    return epoch, close
