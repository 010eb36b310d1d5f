"""`make_loader`: the one factory of every backend: ``"dali"`` (`DALIIterator`), ``"torch"`` (`TorchIterator`),
``"baseline"`` (the plain DataLoader of `baseline`), or ``"auto"``: DALI when it works here, else torch.
Each backend's module is imported only when it is chosen."""

from __future__ import annotations

import logging
from typing import Any

from ..data.base import Reader

log = logging.getLogger(__name__)

BACKENDS = ("baseline", "torch", "dali")  # what a run or a bench row names; make_loader also takes "auto"


def dali_status() -> tuple[bool, str]:
    """(usable, why): whether NVIDIA DALI imports and can build a pipeline here."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali.plugin.pytorch import DALIGenericIterator  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "use the fallback"
        return False, f"nvidia.dali does not import ({type(e).__name__}: {e})"
    return True, "nvidia.dali imports"


_said: set[str] = set()


def _say_once(level: int, message: str) -> None:
    """Log the backend choice once per process (train makes a training and an evaluation loader)."""
    if message not in _said:
        _said.add(message)
        log.log(level, message)


def make_loader(dataset: Reader, batch_size: int, *, backend: str = "auto", **kw: Any) -> Any:
    """A loader of ``dataset`` by ``backend`` (see the module docstring); ``kw`` are the loader's own
    arguments (`LoaderBase`'s, and ``num_workers`` for the DataLoader-based backends). ``"auto"`` logs
    which backend it chose and why, once per process.

    ``"baseline"`` is `baseline.make_baseline_loader`, a plain DataLoader: it takes ``train``,
    ``image_size``, ``num_workers``, ``drop_last``, ``seed``, ``on_error`` and ``recipe``; what it cannot
    honour (a cache, a controller, a device...) is refused in one line, unless left at its default.

    Args:
        dataset: a reader (`open_dataset`).
        batch_size: samples per batch.
        backend: "dali" (`DALIIterator`), "torch" (`TorchIterator`), "baseline" (a plain DataLoader) or
            "auto" (DALI where it runs, else TorchIterator).
        **kw: the chosen loader's arguments (`DALIIterator` lists those every loader takes).
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use 'auto', 'dali', 'torch' or 'baseline'")
    if backend == "baseline":
        from .baseline import TAKES, make_baseline_loader

        given = {k: v for k, v in kw.items() if k not in TAKES and v not in (None, 0, False)}
        if given:
            names = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(f"backend='baseline' (a plain DataLoader) has no {names}; drop it or use backend='torch'")
        return make_baseline_loader(dataset, batch_size, **{k: v for k, v in kw.items() if k in TAKES})
    if backend in ("auto", "dali"):
        ok, why = dali_status()
        if ok:
            from .dali_iterator import DALIIterator

            kw.pop("num_workers", None)
            _say_once(logging.INFO, f"loader: DALI ({why})")
            return DALIIterator(dataset, batch_size, **kw)
        if backend == "dali":
            raise ImportError(f"backend='dali' but {why}; pip install nvidia-dali-cuda120 or use backend='auto'")
        _say_once(logging.WARNING, f"loader: falling back to TorchIterator: {why}")
    else:
        _say_once(logging.INFO, "loader: TorchIterator (asked for backend='torch')")
    from .torch_iterator import TorchIterator

    kw.pop("train_decode", None)  # how DALI decodes: TorchIterator decodes whole images with libjpeg-turbo
    return TorchIterator(dataset, batch_size, **kw)
