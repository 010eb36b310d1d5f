"""`dali-fast bench`: each loader side by side in one run, on the same data and the same work (the rows are
`bench_rows`), written as results.json, a table and bench.png."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.base import Reader
from ..data.open import open_dataset
from ..data.synthetic import default_dataset
from ..data.targets import target_spec
from ..files import atomic_write, check_writable_folder
from ..loaders.factory import BACKENDS
from ..machine import available_cpus, cpus_per_local_rank
from ..text import plural
from ..transforms.mix import MixupCutmix
from ..transforms.recipe import Recipe, resolve_recipe
from . import bench_ranks, report
from .bench_rows import LIMIT, Row, batch_tails, limit_row, loader_row, run_alone
from .bench_table import baseline_for, markdown_table, plot
from .ffcv_row import FFCV, ffcv_missing, ffcv_spec
from .spdl_row import SPDL, check_recipe, spdl_missing
from .tree_memory import TreeMemory, descendants

# What --loaders names: the backends, and FFCV's Loader and SPDL's pipeline where they are installed.
BENCH_ROWS = (*BACKENDS, FFCV, SPDL)

log = logging.getLogger(__name__)


def one_line(error: BaseException) -> str:
    """An error as one line; for a DataLoader worker's error, the worker's own last line, not the wrapper's."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    if len(lines) > 1 and "Original Traceback" in str(error):
        return lines[-1]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def run_bench(
    dataset: str | os.PathLike | Reader | None = None,
    *,
    images: int = 2000,
    loaders: Sequence[str] = BACKENDS,
    epochs: int = 2,
    batch_size: int = 64,
    image_size: int = 224,
    model: str = "none",
    cache_bytes: int = 0,
    controller: bool = False,
    out: str | os.PathLike = "bench-results",
    progress: bool = True,
    on_error: str = "raise",
    recipe: Recipe | None = None,
    augments: Sequence[str | None] | None = None,
    mix: dict[str, float] | None = None,
    limit: bool = True,
    alternate: bool = False,
    emit: Callable[[str], None] = log.info,
    open_options: dict[str, Any] | None = None,
    ranks: int = 1,
    isolate: bool = False,
) -> dict[str, Any]:
    """Benchmark ``loaders`` side by side; writes results.json and bench.png into ``out``.

    ``dataset`` is anything `open_dataset` opens (a path or a URL; ``open_options`` go to it), or a
    reader; None means the synthetic set of ``images``. It is opened once and every row reads that reader, except the baseline, which reads
    the image files of an ImageFolder as a plain script does (the synthetic set's folder, beside its pack).
    Each of ``augments`` (automatic augmentations, None or 'none' for none; default: the recipe's own)
    is one row per loader, ``recipe`` otherwise, so each recipe's cost shows beside the others. With
    ``limit``, the machine's decode-only ceiling on the same data and processes comes first
    (`limit_row`), and each row reads as a share of it. With ``alternate``, every row is started and
    warmed up, then the rows take turns, one timed epoch each, ``epochs`` times: a machine whose load
    changes during the run then slows every row alike (all loaders stay alive meanwhile, so peak memory
    is that of them all, though each row's PSS leaves the other rows' workers out).

    With ``ranks`` > 1 every row runs as that many ranks of a gloo group on this machine, each on its
    shard, the ranks waiting for each other after every step as under DDP (`bench_ranks`); under
    torchrun the launcher's processes are the ranks. A step's time is then the slowest rank's.

    With ``isolate`` each loader's rows, and the limit row, run in a fresh process of their own, one
    after another: each row's memory is then its own, where rows sharing a process inherit what the
    rows before them left in it (freed memory the allocator keeps, libraries loaded)."""
    args = {k: v for k, v in locals().items() if k != "ranks"}
    if FFCV in loaders and (ranks > 1 or bench_ranks.current() or bench_ranks.launched()):
        raise ValueError("the ffcv row runs on one rank; leave ffcv out of --loaders with --ranks or torchrun")
    variants = _variants(loaders, epochs, batch_size, image_size, recipe, augments, mix)
    if isolate and (alternate or ranks > 1):
        raise ValueError(
            "--isolate runs the rows one after another in processes of their own; drop --alternate and --ranks"
        )
    group = bench_ranks.current()
    launched = bench_ranks.launched() if group is None else None
    if ranks < 1 or (launched is not None and ranks not in (1, launched[1])):
        raise ValueError(f"--ranks {ranks}: use 1 or more, or leave it out under torchrun (it starts the ranks)")
    if launched is not None:  # torchrun started this process as one of several ranks: join them, then run
        import torch.distributed as dist

        bench_ranks.join_launched()
        try:
            return run_bench(**args)
        finally:
            dist.destroy_process_group()
    out = Path(out)
    check_writable_folder(out, "--out")
    rank, world = group or (0, 1)
    if rank != 0:  # rank 0 opens (or makes) the data first, the others then open it
        bench_ranks.barrier()
    data = bench_data(dataset, images, progress and rank == 0, open_options)
    if rank == 0 and world > 1:
        bench_ranks.barrier()
    check_batch_fits(batch_size, len(data.reader) // max(world, ranks), data.name)
    if ranks > 1 and group is None:  # the ranks, each a process of its own; this one waits for them
        emit(f"starting {ranks} ranks ...")
        kw = {**args, "emit": log.info, "dataset": dataset if isinstance(dataset, Reader) else data.name}
        if dataset is None:
            kw["dataset"] = None  # each rank finds the synthetic set just made, ImageFolder beside pack
        bench_ranks.spawn(ranks, run_bench, kw)
        return json.loads((out / "results.json").read_text())
    if isolate:
        return _isolated(args, variants, out, emit, data)
    target = target_spec(data.reader)[0]
    if FFCV in loaders and target != "class":  # the .beton holds class labels: said before any row runs
        raise ValueError(f"the ffcv row reads class labels, not {target} targets; leave ffcv out of --loaders")
    out.mkdir(parents=True, exist_ok=True)
    specs: list[tuple[str, Recipe | None]] = [(LIMIT, None)] if limit else []
    specs += [(k, v) for v in variants for k in loaders]
    row_kw = {
        "batch_size": batch_size,
        "image_size": image_size,
        "model": model,
        "cache_bytes": cache_bytes,
        "controller": controller,
        "progress": progress,
        "on_error": on_error,
        "mix": mix,
    }

    def make_row(kind: str, variant: Recipe | None, monitor: Any) -> Row:
        if kind == LIMIT:
            shard = bench_ranks.shard(len(data.files), rank, world) if world > 1 else None
            workers = cpus_per_local_rank()
            return limit_row(
                data.files, workers=workers, batch_size=batch_size, monitor=monitor, progress=progress, indices=shard
            )
        name = kind if len(variants) == 1 else f"{kind} + {_augment_of(variant)}"
        reader = data.files if kind == "baseline" else data.reader
        return loader_row(kind, reader, recipe=variant, monitor=monitor, name=name, **row_kw)

    sync = bench_ranks.StepSync() if world > 1 else None
    several = len(variants) > 1
    results = _run_rows(specs, make_row, epochs=epochs, alternate=alternate, several=several, emit=emit, sync=sync)
    settings = _settings({**args, "dataset": data.name, "images": len(data.reader)}, variants, world)
    if world == 1:
        return _write(results, settings, out)
    gathered = bench_ranks.gather(results)  # rank 0 merges each row over the ranks and writes
    merged = None
    if gathered is not None:
        merged = {k: bench_ranks.merge([g[k] for g in gathered], batch_tails) for k in sorted(results)}
        merged = _write(merged, settings, out)
    return {**bench_ranks.broadcast(merged), "rank": rank}


def _settings(args: dict[str, Any], variants: list[Recipe], world: int) -> dict[str, Any]:
    """What results.json says the run was: the data, the rows, the recipes and the other settings."""
    return {
        "dataset": args["dataset"],
        "images": args["images"],
        "loaders": list(args["loaders"]),
        "epochs": args["epochs"],
        **{k: args[k] for k in ("batch_size", "image_size", "model", "cache_bytes", "controller")},
        "recipes": [v.describe() for v in variants],
        "mix": args["mix"],
        "alternate": args["alternate"],
        "ranks": world,
    }


def _isolated(
    args: dict[str, Any], variants: list[Recipe], out: Path, emit: Callable[[str], None], data: BenchData
) -> dict[str, Any]:
    """`run_bench` with ``isolate``: the limit row, then each loader's rows, each in a fresh process that
    writes into ``out/isolated/<name>``; their rows put together in the usual order and written to ``out``."""
    loaders, parts = list(args["loaders"]), [(LIMIT, [])] if args["limit"] else []
    parts += [(k, [k]) for k in loaders]
    results: dict[int, dict[str, Any]] = {}
    for name, kinds in parts:
        emit(f"benchmarking {'the decode-only limit' if name == LIMIT else name} in a process of its own ...")
        sub = out / "isolated" / name
        kw = {**args, "loaders": kinds, "limit": name == LIMIT, "out": sub, "isolate": False, "emit": log.info}
        try:
            bench_ranks.spawn(1, run_bench, kw)
            got = json.loads((sub / "results.json").read_text())
        except (RuntimeError, OSError, ValueError) as e:
            got = {"limit": {"loader": LIMIT, "error": one_line(e)}, "rows": [{"loader": name, "error": one_line(e)}]}
        if name == LIMIT:
            results[0] = got["limit"]
            continue
        first = len(parts) - len(loaders)  # the limit row, where there is one, comes first
        for v, row in enumerate(got["rows"]):
            results[first + v * len(loaders) + loaders.index(name)] = {**row, "isolated": True}
    settings = _settings({**args, "dataset": data.name, "images": len(data.reader)}, variants, 1)
    settings["isolate"] = True
    return _write(results, settings, out)


def check_batch_fits(batch_size: int, images: int, where: str | os.PathLike) -> None:
    """A batch larger than the data set is one line: every epoch would be a single short batch."""
    if batch_size > images:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the {plural(images, 'image')} of {where}; "
            f"use --batch-size {images} or less, or more images"
        )


def _variants(
    loaders: Sequence[str],
    epochs: int,
    batch_size: int,
    image_size: int,
    recipe: Recipe | None,
    augments: Sequence[str | None] | None,
    mix: dict[str, float] | None,
) -> list[Recipe]:
    """The recipes the rows run (one per augmentation asked for), after a one-line error for any bad
    setting, before any work."""
    for k in loaders:
        if k not in BENCH_ROWS:
            raise ValueError(f"loader {k!r}: choose from {', '.join(BENCH_ROWS)}")
    if epochs < 1 or batch_size < 1 or image_size < 1:
        raise ValueError("epochs, batch size and image size must be >= 1")
    recipe = resolve_recipe(recipe, image_size=image_size)
    if mix:
        MixupCutmix(**mix)  # settings checked before any work
    variants = [
        recipe.with_(auto_augment=None if a in (None, "none") else a)
        for a in (augments if augments else [recipe.auto_augment])
    ]
    if FFCV in loaders:  # where FFCV is missing, or cannot do a setting, one line before any work
        missing = ffcv_missing()
        if missing is not None:
            raise ValueError(missing)
        for variant in variants:
            ffcv_spec(variant)
    if SPDL in loaders:  # the same for SPDL
        missing = spdl_missing()
        if missing is not None:
            raise ValueError(missing)
        for variant in variants:
            check_recipe(variant)
    return variants


def _write(results: dict[int, dict[str, Any]], settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """The result (rows compared, the limit, the table, the machine) written to results.json and bench.png."""
    rows, ceiling = _compared(results)
    info = report.machine_info()
    table = markdown_table(rows, ceiling)
    result = {"settings": settings, "machine": info, "rows": rows, "limit": ceiling, "table": table}
    atomic_write(out / "results.json", lambda f: f.write(json.dumps(result, indent=1, default=str).encode()))
    where = info["gpu"] or f"{info['cpu_count']} CPU cores, no GPU"
    title = f"model={settings['model']}, {settings['image_size']}px, batch {settings['batch_size']} — {where}"
    plot(rows, out / "bench.png", title, ceiling)
    return result


@dataclass(frozen=True)
class BenchData:
    """The data every row reads, opened once: ``reader`` (the loaders'), ``files`` (what the baseline and
    the limit row read: an ImageFolder's image files where there is one, else ``reader``) and ``name``."""

    reader: Reader
    files: Reader
    name: str


def bench_data(
    dataset: str | os.PathLike | Reader | None, images: int, progress: bool, open_options: dict | None = None
) -> BenchData:
    """``dataset`` opened once (`open_dataset` takes paths and URLs alike, and ``open_options``), or the
    synthetic set of ``images``: its pack for the loaders, its ImageFolder for the baseline."""
    if dataset is None:
        folder, packed = default_dataset(images, progress=progress)
        return BenchData(open_dataset(packed), open_dataset(folder), str(packed))
    reader = dataset if isinstance(dataset, Reader) else open_dataset(dataset, **(open_options or {}))
    name = os.fspath(dataset) if isinstance(dataset, str | os.PathLike) else repr(reader)
    return BenchData(reader, reader, name)


def _augment_of(variant: Recipe | None) -> str:
    return "none" if variant is None else variant.auto_augment or "none"


def _run_rows(
    specs: list[tuple[str, Recipe | None]],
    make_row: Callable[[str, Recipe | None, Any], Row],
    *,
    epochs: int,
    alternate: bool,
    several: bool,
    emit: Callable[[str], None],
    sync: bench_ranks.StepSync | None = None,
) -> dict[int, dict[str, Any]]:
    """Each spec's result (or its error, in one line), by position: one row at a time, or all started
    and then timed in turn (``alternate``). A row that fails is named and closed; the others go on.

    Each row's processes are those that appeared under this one while it started and warmed up; the
    PSS of a row's timed epochs leaves the other live rows' processes out. ``sync`` (under --ranks)
    ends every step of every rank together; a row that fails here tells the other ranks through it."""
    from ..train.monitor import UtilizationMonitor

    results: dict[int, dict[str, Any]] = {}
    live: dict[int, Row] = {}
    memory = TreeMemory()
    me = os.getpid()

    def start(k: int, kind: str, variant: Recipe | None, mon: Any) -> Row:
        before = descendants(me)
        row = make_row(kind, variant, mon)
        row.memory, row.sync = memory, sync
        live[k] = row
        row.epoch()  # its warm-up
        row.own = descendants(me) - before
        return row

    def others(k: int) -> set[int]:
        return set().union(*(r.own for j, r in live.items() if j != k))

    def failed(k: int, e: BaseException) -> None:
        kind, variant = specs[k]
        if sync is not None:
            sync.fail()
        why = one_line(e)
        log.error("%s failed: %s", "the limit row" if kind == LIMIT else kind, why)
        results[k] = {"loader": kind, "augment": _augment_of(variant), "error": why}
        if kind == LIMIT:
            results[k]["workers"] = available_cpus()
        row = live.pop(k, None)
        if row is not None:
            row.close()

    errors = (ImportError, RuntimeError, ValueError, OSError)
    with UtilizationMonitor() as mon:
        try:
            for k, (kind, variant) in enumerate(specs):
                what = "the decode-only limit" if kind == LIMIT else kind
                what += "" if kind == LIMIT or not several else f" + {_augment_of(variant)}"
                emit(f"{'starting' if alternate else 'benchmarking'} {what} ...")
                try:
                    row = start(k, kind, variant, mon)
                    if not alternate:
                        row.exclude = others(k)
                        results[k] = run_alone(live.pop(k), epochs, warm=True)
                except errors as e:
                    failed(k, e)
            if alternate:
                emit(f"timing {len(live)} rows in turn, one epoch each, {epochs} times ...")
                for _ in range(epochs):
                    for k in list(live):
                        try:
                            live[k].exclude = others(k)
                            live[k].epoch()
                        except errors as e:
                            failed(k, e)
                results.update({k: row.result() for k, row in live.items()})
        finally:
            for row in live.values():
                row.close()
    return results


def _compared(results: dict[int, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(the loader rows in order, each with its ratio to its baseline and its share of the limit; the limit row)."""
    ordered = [results[k] for k in sorted(results)]
    ceiling = next((r for r in ordered if r["loader"] == LIMIT), None)
    rows = [r for r in ordered if r["loader"] != LIMIT]
    for r in rows:
        base = baseline_for(r, rows)
        if base and "error" not in r:
            r["x_baseline"] = r["img_per_s"] / base
        if ceiling and "error" not in ceiling and "error" not in r:
            r["of_limit"] = r["img_per_s"] / ceiling["img_per_s"]
    return rows, ceiling
