"""A loader's state and its resume: what `LoaderBase.state_dict` holds, and what `LoaderBase.load_state_dict`
checks and applies (the order's own resume, elastic too, is `loaders.order`'s)."""

from __future__ import annotations

from typing import Any

from ..data.classes import classes_key
from ..transforms.recipe import describe_schedule
from .order.base import kept_global_batch


def loader_state(loader: Any) -> dict[str, Any]:
    """``loader``'s state: the order's, whether the epoch was consumed, the batch size, the backend, and the
    controller's and the resolution schedule's where it has them."""
    sd: dict[str, Any] = {
        "sampler": loader.order.state_dict(),
        "finished": loader._finished,
        "batch_size": loader._batch_size,
        "backend": loader.backend,
    }
    classes = getattr(loader.dataset, "classes", None)
    if classes is not None:  # the class map: a resume on another is refused
        sd["classes"] = classes_key(classes)
    if loader.controller is not None:
        sd["controller"] = loader.controller.state_dict()
    if loader.resolution is not None:
        sd["resolution"] = loader.resolution
        sd["image_size"] = loader.image_size
    return sd


def load_loader_state(loader: Any, state: dict[str, Any]) -> None:
    """Apply ``state`` to ``loader`` (a `LoaderBase`), or refuse it in one line, changing nothing: not a
    loader state, another order or resolution schedule, or a mid-epoch batch size that a length already
    counted would contradict (`check_counted_length`). On another world size the global batch is kept."""
    sampler = state.get("sampler") if isinstance(state, dict) else None
    if not isinstance(sampler, dict) or not {"epoch", "position"} <= set(sampler):
        raise ValueError("not a loader state_dict (no 'sampler' epoch and position); pass loader.state_dict() as saved")
    saved_kind, kind = sampler.get("order", "random"), loader.order.kind
    if saved_kind != kind:
        raise ValueError(
            f"cannot resume: the state was saved with the {saved_kind} order, this data set uses the {kind} "
            "order; resume with the data set it was saved with"
        )
    classes = getattr(loader.dataset, "classes", None)
    saved_map, my_map = state.get("classes"), None if classes is None else classes_key(classes)
    if saved_map is not None and my_map is not None and saved_map != my_map:  # a state saved before keys has none
        raise ValueError(
            f"cannot resume: the state was saved with another class map ({saved_map.split(':')[0]} classes, this "
            f"data set has {my_map.split(':')[0]}, or other names); open the data set with the classes it was "
            "saved with (classes=, --classes FILE)"
        )
    saved, mine = state.get("resolution"), loader.resolution
    if saved != mine:
        raise ValueError(
            f"cannot resume: the state was saved with resolution schedule {describe_schedule(saved)}, this loader "
            f"has {describe_schedule(mine)}; resume with the recipe it was saved with"
        )
    check_counted_length(loader, state)
    loader.order.load_state_dict(sampler)
    loader._finished = bool(state.get("finished", False))
    loader._batch_size = int(state.get("batch_size", loader._batch_size))
    saved_world = int(sampler.get("world_size", loader.world_size))
    if saved_world != loader.world_size and loader.controller is None:  # a controller sizes batches per rank
        loader._batch_size = kept_global_batch(loader._batch_size, saved_world, loader.world_size)
    if loader.controller is not None and "controller" in state:
        loader.controller.load_state_dict(state["controller"])


def check_counted_length(loader: Any, state: dict[str, Any]) -> None:
    """Refuse a mid-epoch state of another batch size once ``len(loader)`` was counted at this one: a framework
    that counts an epoch's batches before it restores the loader (Lightning does) keeps its count and its
    own place in it, so the rest of the epoch at another batch size would end early (samples never
    delivered) or run past the loader's end. Between epochs any batch size resumes (positions count samples)."""
    counted = loader.__dict__.get("_counted_at")
    sampler = state["sampler"]
    saved = int(state.get("batch_size", loader._batch_size))
    mid_epoch = int(sampler["position"]) > 0 and not state.get("finished", False)
    same_world = int(sampler.get("world_size", loader.world_size)) == loader.world_size
    if counted is None or counted == saved or not mid_epoch or not same_world or loader.controller is not None:
        return
    raise ValueError(
        f"cannot resume mid-epoch at batch size {saved}: len() counted this epoch's batches at batch size "
        f"{counted}, and a framework that counts them before it restores the loader (Lightning does) would end "
        f"the epoch after that count; make the loader with batch_size={saved} to finish this epoch (change "
        "loader.batch_size between epochs)"
    )
