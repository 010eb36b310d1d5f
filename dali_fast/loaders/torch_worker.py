"""`TorchIterator`'s worker side: what runs in each decode process. A worker takes a `Task` (a part of a
batch and the shared-memory slot to write it into), and decodes, crops, resizes, augments and mirrors each
image straight into that slot (`BatchMaker`); it sends back only labels, erasing boxes and the bad records
it met (and the indices of the good records, from which the main process makes target rows): no
per-sample tensors, no pickled pixels, no collate copy.

Per sample, the crop, flip, policy and erasing box are drawn from (seed, epoch, index), as in every
loader here, so the pixels do not depend on the number of workers, the batch size or a resume. The main
process's side (the slots, the tasks, the outputs) is `torch_slots`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import platform
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..data.base import Reader, read_batch_checked
from ..transforms.autoaugment import apply_policy
from ..transforms.decode import Decoder
from ..transforms.draws import SampleDraws, crop_draws, sample_erasing_box, sample_rng
from ..transforms.opencv import single_threaded_worker, split_channels
from ..transforms.recipe import AUGMENT_SALT, Recipe
from ..transforms.resize import BadImage, decode_crop
from .torch_slots import IDLE, Task
from .torch_watch import DUMP_SIGNAL

log = logging.getLogger(__name__)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tame_malloc(arenas: int = 2, mmap_threshold: int = 1 << 20) -> bool:
    """Keep a long-lived decode process's heap from growing epoch after epoch (glibc only).

    Varying image sizes make glibc raise its mmap threshold after each large free, so later large
    buffers come from the heap, which then fragments, and extra arenas multiply it. A fixed threshold
    (buffers above it are mapped and returned whole) and two arenas keep the resident set flat
    (benchmarks/worker_rss.py). Returns whether the settings were applied.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_ARENA_MAX, arenas) == 1
    ok &= mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold) == 1
    return bool(ok)


def worker_init(_worker_id: int) -> None:
    """DataLoader ``worker_init_fn`` of the decode workers. A worker that crashes (a segmentation fault in a
    native library) writes its Python stack to stderr before DataLoader reports it dead, so the report names
    the place, not only the signal; so does one found stuck (`torch_watch`), before it is killed."""
    with contextlib.suppress(AttributeError, ValueError, OSError):  # a stderr without a file descriptor
        faulthandler.disable()  # enabled before the fork, it would now be DataLoader's handler's, not ours
        faulthandler.enable()  # the stack, then the signal's default: DataLoader reports the worker dead
        faulthandler.register(DUMP_SIGNAL, all_threads=True)  # a stuck worker's stack, before it is killed
    tame_malloc()
    single_threaded_worker()


IDLE_WAIT = 0.001  # seconds a worker waits on an idle task, so that a run of them costs little CPU


class BatchMaker(Dataset):
    """Runs in the workers: a `Task` → its images written into the slot, and the part's metadata.

    Good samples are packed from the task's offset on, in plan order; bad records (unreadable, failing
    the structural check, undecodable) are listed with their reason, never raised, so the consumer
    decides (``on_error``) and names them.
    """

    def __init__(
        self, reader: Reader, train: bool, recipe: Recipe, seed: int, buffer: torch.Tensor, layout: str
    ) -> None:
        self.reader, self.train, self.recipe, self.seed = reader, train, recipe, seed
        self.buffer, self.layout = buffer, layout
        self._decoder: Decoder | None = None
        self._tmp: torch.Tensor | None = None
        self._mirrored: np.ndarray | None = None  # a mirrored image on its way into the slot

    def __len__(self) -> int:
        return len(self.reader)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_decoder"], state["_tmp"], state["_mirrored"] = None, None, None  # per process, made on first use
        return state

    def __getitems__(self, task: Task) -> dict[str, Any]:
        """DataLoader's batched fetch (its batch sampler yields `Task`s)."""
        return self.make(task)

    def make(self, task: Task) -> dict[str, Any]:
        if task.slot == IDLE:
            time.sleep(IDLE_WAIT)
            return {"slot": IDLE}
        if self._decoder is None:
            self._decoder = Decoder()
            S = self.recipe.image_size
            self._tmp = torch.empty((S, S, 3), dtype=torch.uint8)
            self._mirrored = np.empty((S, S, 3), dtype=np.uint8)
        keys = task.keys
        if keys and len(keys[0]) > 2:  # read (and checked) in the main process, through its cache
            datas = [key[2] for key in keys]
            found = [key[3] for key in keys]
            reasons = {pos: key[4] for pos, key in enumerate(keys) if key[4] is not None}
        else:  # one read of the whole part: O(1) checks per packed record, files read in parallel
            datas, found, reasons = read_batch_checked(self.reader, [key[0] for key in keys])
        slot = self.buffer[task.slot].numpy()
        draws = self._draws(keys)
        at = task.offset
        labels: list[int] = []
        good: list[int] = []
        boxes: list[tuple[int, int, int, int]] = []
        bad: list[tuple[int, str]] = []
        for pos, key in enumerate(keys):
            index = key[0]
            reason = reasons.get(pos)
            if reason is None:
                reason, box = self._sample(datas[pos], index, key[1], slot[at], draws[pos])
            if reason is not None:
                bad.append((index, reason))
                continue
            at += 1
            labels.append(int(found[pos]))
            good.append(index)
            if box is not None:
                boxes.append(box)
        return {
            "slot": task.slot,
            "batch": task.batch,
            "offset": task.offset,
            "part": task.part,
            "parts": task.parts,
            "n": len(labels),
            "labels": np.asarray(labels, dtype=np.int64),
            "indices": np.asarray(good, dtype=np.int64),
            "boxes": np.asarray(boxes, dtype=np.int64).reshape(-1, 4) if boxes else None,
            "consumed": len(keys),
            "bad": bad,
        }

    def _draws(self, keys: list[tuple]) -> list[list[float]]:
        """Each key's crop and flip uniforms (`crop_draws`), for the part at once."""
        if not self.train or not keys:
            return [[]] * len(keys)
        epoch = keys[0][1]
        if all(key[1] == epoch for key in keys):
            return crop_draws(self.seed, epoch, [key[0] for key in keys])
        return [crop_draws(self.seed, key[1], [key[0]])[0] for key in keys]

    def _sample(
        self, data: Any, index: int, epoch: int, out: np.ndarray, uniforms: list[float]
    ) -> tuple[str | None, tuple[int, int, int, int] | None]:
        """Decode, crop, resize, augment and mirror one record into ``out`` (its place in the slot, in the
        slot's layout), the crop and flip drawn from ``uniforms``; (why it is bad, erasing box)."""
        recipe = self.recipe
        rng = SampleDraws(uniforms)
        tmp: torch.Tensor = self._tmp  # type: ignore[assignment]
        try:
            image = decode_crop(data, train=self.train, recipe=recipe, rng=rng, decoder=self._decoder, out=tmp)
        except BadImage as e:
            return str(e), None
        flip, box = False, None
        if self.train:
            flip = bool(rng.random() < recipe.hflip)
            if recipe.auto_augment is not None:
                augmented = apply_policy(image.numpy(), recipe, sample_rng(self.seed, epoch, index, AUGMENT_SALT))
                np.copyto(tmp.numpy(), augmented)
                image = tmp
            if recipe.random_erasing > 0:
                box = sample_erasing_box(recipe, self.seed, epoch, index)
        src = image.numpy()
        if self.layout == "CHW" and split_channels(src, out, flip, self._mirrored):
            return None, box
        src = src[:, ::-1] if flip else src
        # without OpenCV, numpy's transposing copy is the cheaper one here (CHW), mirrored or not
        np.copyto(out, src.transpose(2, 0, 1) if self.layout == "CHW" else src)
        return None, box


def collate_as_is(batch: Any) -> Any:
    """DataLoader ``collate_fn``: the worker's batch is already made."""
    return batch
