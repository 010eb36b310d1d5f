"""The loader contract as one checker that every backend's and framework's tests call (torchdata's
``run_test_save_load_state`` is the model): each epoch gives each sample exactly once; a state taken
mid-epoch resumes at exactly the next sample, in the same order, and the epochs after it are the ones an
uninterrupted run would have given; a state from the start, or from the end of an epoch, resumes there;
``close()`` in the middle of a pass ends that pass the same way for every loader."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any


def each_once(seen: Iterable[int], universe: Iterable[int], *, padding: int = 0, what: str = "the epoch") -> None:
    """``seen`` (sample ids as delivered, over one epoch of every rank) holds each id of ``universe`` once;
    ``padding`` more deliveries may repeat ids (the wrap-around that evens out ranks without drop_last)."""
    seen, universe = list(seen), set(universe)
    counts = Counter(seen)
    missing = sorted(universe - set(counts))
    foreign = sorted(set(counts) - universe)
    repeats = sum(c - 1 for c in counts.values())
    assert not missing and not foreign and repeats <= padding, (
        f"{what}: {len(missing)} missing {missing[:8]}, {len(foreign)} foreign {foreign[:8]}, "
        f"{repeats} repeated (at most {padding} allowed)"
    )


def last_indices(loader: Any, batch: Any) -> list[int]:
    """The data set indices a batch accounts for (every loader of this package keeps them)."""
    return loader.last_indices.tolist()


def _take(loader: Any, ids: Callable, count: int | None = None) -> tuple[list[list[int]], Any]:
    """The ids of the next ``count`` batches of a pass (all of it when None), and the pass (still open)."""
    it = iter(loader)
    out: list[list[int]] = []
    for batch in it:
        out.append(ids(loader, batch))
        if count is not None and len(out) == count:
            break
    return out, it


def run_save_load_state(
    make: Callable[[], Any],
    midpoint: int,
    *,
    ids: Callable[[Any, Any], list[int]] = last_indices,
    universe: Iterable[int] | None = None,
) -> None:
    """Check a loader made by ``make()`` (the same settings each call) against the contract.

    Runs two epochs uninterrupted, with states taken at the start, after ``midpoint`` batches of each
    epoch, and at the end of the first; then, each in a new loader as a restarted process would, loads:
    the mid-epoch-0 state (the rest of epoch 0, then epoch 1 as before), the mid-epoch-1 state (the rest
    of epoch 1), the initial state (both epochs as before), the end-of-epoch-0 state (epoch 1). A loader
    is also resumed in place, as a framework reloading a checkpoint into a live loader does. ``ids`` names
    the samples of a batch; each epoch covers ``universe`` (default: every record) exactly once.
    """
    x = make()
    universe = set(range(len(x.dataset))) if universe is None else set(universe)
    initial = x.state_dict()
    head0, it = _take(x, ids, midpoint)
    mid0 = x.state_dict()
    epoch0 = head0 + [ids(x, batch) for batch in it]
    end0 = x.state_dict()
    head1, it = _take(x, ids, midpoint)
    mid1 = x.state_dict()
    epoch1 = head1 + [ids(x, batch) for batch in it]
    assert len(head0) == midpoint and len(epoch0) > midpoint, "the epoch is too short for the midpoint"
    for k, epoch in enumerate((epoch0, epoch1)):
        each_once((i for batch in epoch for i in batch), universe, what=f"epoch {k}")
    assert epoch0 != epoch1, "two epochs in the same order: the order does not follow the epoch"

    def resumed(state: dict, loader: Any = None) -> tuple[list[list[int]], list[list[int]]]:
        loader = make() if loader is None else loader
        loader.load_state_dict(state)
        first, _ = _take(loader, ids)
        second, _ = _take(loader, ids)
        return first, second

    assert resumed(mid0) == (epoch0[midpoint:], epoch1), "resumed mid-epoch 0: not exactly the rest, then epoch 1"
    assert resumed(mid0, x) == (epoch0[midpoint:], epoch1), "resumed in place mid-epoch 0: not exactly the rest"
    assert resumed(mid1)[0] == epoch1[midpoint:], "resumed mid-epoch 1: not exactly the rest of it"
    assert resumed(initial) == (epoch0, epoch1), "the initial state: not the uninterrupted run"
    assert resumed(end0)[0] == epoch1, "the end of epoch 0: the next pass is not epoch 1"


def run_close_mid_pass(
    make: Callable[[], Any],
    midpoint: int,
    *,
    ids: Callable[[Any, Any], list[int]] = last_indices,
    universe: Iterable[int] | None = None,
) -> None:
    """``close()`` between two batches of a pass, the one rule for every loader: the pass yields nothing
    more, and asking it for its next batch raises one `RuntimeError` (one line, naming ``close()``); the
    state taken after the close resumes at exactly the next sample; the next ``iter()`` runs the whole
    epoch again, each sample once (as after a ``break``); a pass made before ``close()`` but not started
    ends the same way; and ``close()`` twice, or with no pass, is harmless."""
    x = make()
    universe = set(range(len(x.dataset))) if universe is None else set(universe)
    head, it = _take(x, ids, midpoint)
    assert len(head) == midpoint, "the epoch is too short for the midpoint"
    x.close()
    state = x.state_dict()
    _refuses_after_close(it, "a pass closed after its first batches")
    x.close()  # twice: harmless
    whole, _ = _take(x, ids)
    each_once((i for batch in whole for i in batch), universe, what="the pass after close()")
    assert whole[:midpoint] == head, "the pass after close(): not the same epoch from its start"
    resumed = make()
    resumed.load_state_dict(state)
    rest, _ = _take(resumed, ids)
    assert head + rest == whole, "the state taken after close(): does not resume at exactly the next sample"
    unstarted = iter(x)
    x.close()
    _refuses_after_close(unstarted, "a pass made before close() and not started")
    again, _ = _take(x, ids)
    assert len(again) == len(whole), "close() left the loader unable to run another pass"
    x.close()
    resumed.close()


def _refuses_after_close(it: Any, what: str) -> None:
    try:
        next(it)
    except RuntimeError as e:
        text = str(e)
        assert "close()" in text and "\n" not in text, f"{what}: the error is not one line naming close(): {text!r}"
    except StopIteration:
        raise AssertionError(f"{what}: ended in silence instead of raising that the loader was closed") from None
    else:
        raise AssertionError(f"{what}: yielded a batch after close()")
