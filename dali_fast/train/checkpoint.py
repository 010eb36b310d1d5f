"""Checkpoint files and the training audit trail.

`save_checkpoint` writes atomically (temp file, fsync, rename), so a kill at any point leaves the
previous checkpoint whole; `load_checkpoint` refuses other versions and unreadable files in one
line; `check_resume_config` refuses a resume whose settings differ from the saved run's; `rank_state`
and `resume_batch_size` say what each rank resumes from and with which batch size, also on another
number of ranks; `IndexRecorder` writes one JSON line per batch (what training saw), flushed as it goes.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import torch

from ..files import atomic_write

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_VERSION = 2  # 2: a checksummed payload, and the data set's fingerprint in the saved settings
CHECKPOINT_MAGIC = b"DFCKPT\x00\x02"  # then the payload's sha256, then the torch.save payload


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` so that ``path`` always holds a whole, checksummed checkpoint: temp file, fsync, rename.

    The file is ``CHECKPOINT_MAGIC``, the sha256 of the payload, then the payload (``torch.save``).
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()

    def write(f: BinaryIO) -> None:
        f.write(CHECKPOINT_MAGIC)
        f.write(hashlib.sha256(payload).digest())
        f.write(payload)

    atomic_write(path, write, durable=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by `save_checkpoint`: checksum verified, tensors and plain Python only."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint there; train once with --checkpoint to write one")
    blob = path.read_bytes()
    head = len(CHECKPOINT_MAGIC)
    if blob[:head] != CHECKPOINT_MAGIC:
        raise ValueError(
            f"{path}: not a dali-fast checkpoint of this version (no {CHECKPOINT_MAGIC[:6].decode()} header); "
            "resume with the version that wrote it, or delete it to start over"
        )
    digest, payload = blob[head : head + 32], memoryview(blob)[head + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(f"{path}: checksum mismatch, the checkpoint is damaged; delete it to start over")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise ValueError(
            f"{path}: not a readable dali-fast checkpoint ({type(e).__name__}); delete it to start over"
        ) from e
    version = state.get("version") if isinstance(state, dict) else None
    if version != CHECKPOINT_VERSION:
        raise ValueError(
            f"{path}: checkpoint version {version}, this dali-fast reads version {CHECKPOINT_VERSION}; "
            "resume with the version that wrote it or start a new --checkpoint folder"
        )
    return state


def check_resume_config(
    path: str | Path,
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, in one line naming the first setting that differs and both its values, to resume a run saved
    with other settings. A setting made of fields (the recipe, the batch mixing) is compared field by
    field and the field is named (``recipe.random_erasing``), not the whole setting. A setting only one
    side has stands for ``defaults[key]`` on the other (what leaving it out means), else for None."""
    found = _first_difference(saved, current, defaults or {})
    if found is not None:
        key, was, now = found
        raise ValueError(
            f"{path}: saved with {key}={was!r}, this run has {key}={now!r}; "
            "resume with the same settings or use a new --checkpoint folder"
        )


def check_resume_classes(path: str | Path, saved: Sequence[str] | None, current: Sequence[str]) -> None:
    """Refuse, in one line naming the first difference, to resume a run saved with another class map (the
    same label would mean another class). A checkpoint written before maps were saved has none: nothing
    to check."""
    if saved is None or list(saved) == list(current):
        return
    k = next((i for i, (a, b) in enumerate(zip(saved, current, strict=False)) if a != b), None)
    detail = (
        f"{len(saved)} classes, this run has {len(current)}"
        if k is None
        else f"class {k} was {saved[k]!r}, this run calls it {current[k]!r}"
    )
    raise ValueError(
        f"{path}: saved with another class map ({detail}); resume on data of the same classes (--classes FILE "
        "declares them) or use a new --checkpoint folder"
    )


def _first_difference(
    saved: Mapping[str, Any], current: Mapping[str, Any], defaults: Mapping[str, Any], prefix: str = ""
) -> tuple[str, Any, Any] | None:
    """(dotted name, saved value, current value) of the first setting that differs, or None."""
    for key in [*current, *(k for k in saved if k not in current)]:
        was = saved[key] if key in saved else defaults.get(key)
        now = current[key] if key in current else defaults.get(key)
        if was == now:
            continue
        if isinstance(was, Mapping) and isinstance(now, Mapping):
            inner = _first_difference(was, now, {}, f"{prefix}{key}.")
            if inner is not None:
                return inner
        return f"{prefix}{key}", was, now
    return None


def rank_state(
    path: str | Path, ranks: Sequence[Mapping[str, Any]], rank: int, world_size: int
) -> tuple[dict[str, Any] | None, dict[str, float]]:
    """(loader state, the epoch's partial sums) rank ``rank`` of ``world_size`` resumes from, out of the
    per-rank entries (``loader``, ``partial``) of a checkpoint saved by ``len(ranks)`` ranks.

    On the same number of ranks, each its own. On another, every rank loads rank 0's loader state: in a
    lockstep run the ranks stopped at the same place, so one state says what the whole job consumed and
    the loader resumes elastically (a checkpoint whose ranks disagree is refused in one line). The saved
    ranks' partial sums (samples, loss) are summed over ranks later, so rank 0 takes them all."""
    if len(ranks) == world_size:
        return ranks[rank]["loader"], dict(ranks[rank]["partial"])
    states = [r["loader"] for r in ranks]
    places = {
        json.dumps([s["sampler"]["epoch"], s["sampler"]["position"], s["sampler"].get("history", [])])
        for s in states
        if s is not None
    }
    if len(places) > 1:
        raise ValueError(
            f"{path}: the {len(ranks)} saved ranks stopped at different places in the epoch ({', '.join(sorted(places))}); "
            f"resume on {len(ranks)} processes"
        )
    partial = {"samples": 0, "loss_sum": 0.0}
    if rank == 0:
        partial = {key: sum(r["partial"][key] for r in ranks) for key in partial}
    return states[0], partial


def resume_batch_size(
    saved: int, saved_world: int, given: int, world: int, most: int | None = None
) -> tuple[int, str | None]:
    """(per-rank batch size, the line that says what changed, or None) of a resume on ``world`` ranks of a
    run saved on ``saved_world`` ranks with ``saved`` per rank, given ``given`` (``--batch-size``).

    Another ``given`` is taken as given. The same one on another number of ranks keeps the global batch
    (``saved * saved_world``) when it splits into ``world`` equal batches of at most ``most`` (the samples
    a rank has, when the tail batch is dropped); else the per-rank size stays and the line says the
    global batch changed. The learning rate is not rescaled."""
    total = saved * saved_world
    if given != saved:
        if world == saved_world:
            return given, f"batch size {saved} → {given} as given"
        return given, (
            f"batch size {saved} → {given} as given, with ranks {saved_world} → {world} "
            f"(a global batch of {given * world}, was {total})"
        )
    if world == saved_world:
        return given, None
    kept = total // world
    if total % world == 0 and (most is None or kept <= most):
        return (
            kept,
            f"ranks {saved_world} → {world}: batch size {saved} → {kept} per rank, the global batch stays {total}",
        )
    return saved, (
        f"ranks {saved_world} → {world}: a global batch of {total} does not split into {world} equal batches"
        + ("" if total % world else f" of at most {most} samples")
        + f", so the batch size stays {saved} per rank (a global batch of {saved * world}; the learning rate is unchanged)"
    )


def plain(obj: Any) -> Any:
    """Rows and states as plain Python (numpy scalars become numbers), loadable with weights_only."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


class IndexRecorder:
    """Appends one JSON line per batch (epoch, step, rank, data set indices): what training saw.

    ``path`` may contain ``{rank}``; with several ranks and no placeholder, ``.rank<N>`` is appended.
    Each line is flushed when written, so a killed run leaves every batch it trained on.
    """

    def __init__(self, path: str | Path, rank: int = 0, world_size: int = 1) -> None:
        text = str(path)
        if "{rank}" in text:
            text = text.format(rank=rank)
        elif world_size > 1:
            text = f"{text}.rank{rank}"
        self.path = Path(text)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, epoch: int, step: int, indices: Sequence[int]) -> None:
        line = {"epoch": epoch, "step": step, "rank": self.rank, "indices": [int(i) for i in indices]}
        self._f.write(json.dumps(line) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> IndexRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_index_records(path: str | Path) -> list[dict[str, Any]]:
    """The lines an `IndexRecorder` wrote; a last line cut short by a kill is left out."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
