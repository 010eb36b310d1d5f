"""The preemption fuzz's ``dali-fast train`` trials, under torchrun: the job SIGKILLed rank by rank at a random
batch and resumed with ``--resume`` on a world size (and batch size, workers) drawn anew (mode ``train``);
or one rank SIGKILLed while the others go on, and torchrun's elastic agent restarting the group
(``--max-restarts 1``; every restarted rank resumes from the checkpoint: mode ``restart``). What each rank
trained on comes from ``--record-indices``; what was committed, from the checkpoint's step."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import preemption_rank as rk
from preemption_check import END, Gen

TIMEOUT = 300.0  # seconds a torchrun job may take


def universe(trial: Any, env: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The training set as ``train`` splits it (ids, and its shard bounds where it streams), in a child."""
    from preemption_fuzz import run_child

    out = folder / "universe.json"

    def probe(job: dict[str, Any]) -> None:
        from dali_fast.data.base import StreamingSubset, split
        from dali_fast.data.open import open_dataset

        kw = {}
        if trial.kind == "s3":
            kw = {"storage_options": {"endpoint_url": env["endpoint"]}, "cache_dir": str(folder / "s3-cache")}
        reader = open_dataset(rk.kind_path(trial.kind, Path(env["data"])), **kw)
        train, _ = split(reader, 0.2, trial.settings["seed"])
        streams = isinstance(train, StreamingSubset) and train.streaming
        layout = {
            "n": len(train),
            "ids": train.indices.tolist(),
            "bounds": train.shard_bounds.tolist() if streams else None,
            "window": int(train.shuffle_window) if streams else None,
        }
        out.write_text(json.dumps(layout))

    run_child(probe, {}, folder / "universe")
    return json.loads(out.read_text())


def command(trial: Any, env: dict[str, Any], gen: dict[str, Any], folder: Path, tag: str, restarts: int) -> list[str]:
    s = trial.settings
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gen['world']}"]
    if restarts:
        launcher.append(f"--max-restarts={restarts}")
    args = [
        "train",
        rk.kind_path(trial.kind, Path(env["data"])),
        "--loader",
        trial.backend,
        "--epochs",
        str(s["epochs"]),
    ]
    args += ["--model", "resnet_tiny", "--image-size", "8", "--batch-size", str(gen["batch"]), "--seed", str(s["seed"])]
    args += ["--num-workers", str(gen["workers"]), "--checkpoint", str(folder / "ck"), "--resume"]
    args += ["--checkpoint-every", str(s["save_every"]), "--record-indices", str(folder / f"{tag}.jsonl")]
    if not s["drop_last"]:
        args.append("--no-drop-last")
    if s["controller"]:
        args.append("--controller")
    if s["progressive"]:
        args += ["--progressive", "8:16:0:1:8"]
    if trial.kind == "s3":
        args += ["--storage-option", f"endpoint_url={env['endpoint']}", "--cache-dir", str(folder / "s3-cache")]
    return [*launcher, "-m", "dali_fast", *args]


def ranks_of(pid: int) -> dict[int, int]:
    """{rank: pid} of the torchrun workers under ``pid`` (from each process's ``RANK``)."""
    out = {}
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if (
                rank
                and b"TORCHELASTIC_RUN_ID=" in b"\0".join(environ)
                and Path(f"/proc/{p}/cmdline").read_bytes().count(b"dali_fast")
            ):
                out.setdefault(int(rank[0]), p)
    return out


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def records(folder: Path, tag: str, world: int) -> dict[int, list[dict[str, Any]]]:
    from dali_fast.train.checkpoint import read_index_records

    paths = {0: folder / f"{tag}.jsonl"} if world == 1 else {r: folder / f"{tag}.jsonl.rank{r}" for r in range(world)}
    return {r: read_index_records(p) if p.exists() else [] for r, p in paths.items()}


def to_gen(world: int, recs: dict[int, list[dict[str, Any]]], start: Any, epochs: int) -> Gen:
    gen = Gen(world, {r: [((x["epoch"], x["step"]), x["indices"]) for x in xs] for r, xs in recs.items()}, start)
    for xs in recs.values():
        for x in xs:
            gen.batches[x["epoch"]] = max(gen.batches.get(x["epoch"], 0), len(x["indices"]))
    return gen


def commit_of(folder: Path) -> Any:
    """Where the checkpoint is: (epoch, step), or (epoch, `END`) when it closed its epoch; None without one."""
    from dali_fast.train.checkpoint import load_checkpoint

    path = folder / "ck" / "checkpoint.pt"
    if not path.exists():
        return None
    state = load_checkpoint(path)
    return (int(state["epoch"]), END) if state["epoch_done"] else (int(state["epoch"]), int(state["step"]))


def run(trial: Any, rng: np.random.Generator, env: dict[str, Any], folder: Path) -> tuple[list[Gen], dict[str, Any]]:
    from preemption_fuzz import draw_gen

    folder.mkdir(parents=True, exist_ok=True)
    layout = universe(trial, env, folder)
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if trial.mode == "restart":
        return [*_restart(trial, rng, env, folder, environ, layout)], layout
    gens: list[Gen] = []
    start, previous, batch, world = None, None, 1, 1
    kills = int(rng.integers(1, 3))
    s = trial.settings
    for g in range(kills + 1):
        gen = draw_gen(rng, trial, previous)
        trial.resized += previous is not None and gen["world"] != previous
        previous = gen["world"]
        s.setdefault("worlds", []).append(gen["world"])
        per_epoch = -(-layout["n"] // gen["world"]) // gen["batch"]
        target = int(rng.integers(1, max(2, per_epoch * gen["world"] * 2)))  # records of all ranks, 1st or 2nd epoch
        out = open(folder / f"g{g}.out", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            command(trial, env, gen, folder, f"g{g}", 0), env=environ, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            killed = _watch(proc, folder, f"g{g}", gen["world"], None if g == kills else target, rng)
        except BaseException:  # the fuzz stopped (or the job hung): nothing of this job outlives it
            _kill_tree(proc.pid)
            raise
        finally:
            out.close()
        recs = records(folder, f"g{g}", gen["world"])
        record = to_gen(gen["world"], recs, start, s["epochs"])
        record.batch = max(gen["batch"], batch * world // gen["world"])  # as given, or the global batch kept
        batch, world = record.batch, gen["world"]
        _said_batches(record, folder / f"g{g}.out")
        if killed is None:
            if proc.returncode != 0:
                trial.failures.append(
                    f"train generation {g} exited with {proc.returncode}: {_tail(folder / f'g{g}.out')}"
                )
                gens.append(record)
                return gens, layout
            record.commit = (s["epochs"] - 1, END)
            gens.append(record)
            return gens, layout
        trial.kills += killed
        trial.resumes += 1
        record.commit = commit_of(folder)
        gens.append(record)
        start = record.commit if record.commit is not None else start
    return gens, layout


def _watch(
    proc: subprocess.Popen, folder: Path, tag: str, world: int, target: int | None, rng: np.random.Generator
) -> int | None:
    """Wait for the job; with ``target``, SIGKILL its ranks one by one (each a moment after the other) once
    the ranks have recorded ``target`` batches, then the agent. Returns the ranks killed (None: none)."""
    deadline = time.monotonic() + TIMEOUT
    while proc.poll() is None:
        if time.monotonic() > deadline:
            _kill_tree(proc.pid)
            proc.wait()
            raise RuntimeError(f"torchrun job {tag} hung")
        if target is not None and sum(len(x) for x in records(folder, tag, world).values()) >= target:
            ranks = ranks_of(proc.pid)
            for rank in sorted(ranks, key=lambda _: rng.random()):
                _kill_tree(ranks[rank])  # the rank and its decode workers
                time.sleep(float(rng.uniform(0, 0.05)))
            _kill_tree(proc.pid)
            proc.wait()
            return len(ranks)
        time.sleep(0.02)
    return None


def _said_batches(gen: Gen, out: Path) -> None:
    """Each epoch's batch size as ``train`` printed it ("epoch 1: ... batch 16, 8 px"), where it is larger than
    the batches recorded (a controller's, in an epoch whose rest held no whole batch)."""
    for epoch, size in re.findall(r"^epoch (\d+): loss .*?, batch (\d+), ", out.read_text(errors="replace"), re.M):
        gen.batches[int(epoch)] = max(gen.batches.get(int(epoch), 0), int(size))


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (torchrun starts each rank in a session of its own)."""
    for p in _tree(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-1500:]


def _restart(
    trial: Any, rng: np.random.Generator, env: dict[str, Any], folder: Path, environ: dict, layout: dict
) -> list[Gen]:
    """One rank dies; the agent restarts the group, which resumes from the checkpoint: two generations of
    the same world size, told apart in each rank's records where the step goes back."""
    from preemption_fuzz import draw_gen

    s = trial.settings
    gen = draw_gen(rng, trial, None)
    gen.update(world=max(2, gen["world"]), batch=min(gen["batch"], 4))
    s["worlds"] = [gen["world"], gen["world"]]
    out = open(folder / "run.out", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        command(trial, env, gen, folder, "run", 1), env=environ, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        return _restarted(trial, rng, folder, gen, proc, out)
    except BaseException:  # the fuzz stopped: nothing of this job outlives it
        _kill_tree(proc.pid)
        raise


def _restarted(trial: Any, rng: np.random.Generator, folder: Path, gen: dict, proc: Any, out: Any) -> list[Gen]:
    """`_restart`'s watch over its job (one rank killed once it trained past a checkpoint) and what it saw."""
    s = trial.settings
    victim = int(rng.integers(gen["world"]))
    target = int(rng.integers(s["save_every"] + 1, 2 * s["save_every"] + 2))  # a batch or two past a checkpoint
    deadline, killed = time.monotonic() + TIMEOUT, False
    while proc.poll() is None:
        if time.monotonic() > deadline:
            _kill_tree(proc.pid)
            proc.wait()
            trial.failures.append("the restarted torchrun job hung")
            return []
        recs = records(folder, "run", gen["world"])
        if not killed and len(recs[victim]) >= target and (folder / "ck" / "checkpoint.pt").exists():
            pid = ranks_of(proc.pid).get(victim)
            if pid is not None:
                _kill_tree(pid)
                killed = True
        time.sleep(0.02)
    out.close()
    if proc.returncode != 0:
        trial.failures.append(f"the restarted torchrun job exited with {proc.returncode}: {_tail(folder / 'run.out')}")
        return []
    recs = records(folder, "run", gen["world"])
    drops = [xs[k]["step"] for xs in recs.values() for k in range(1, len(xs)) if xs[k]["step"] <= xs[k - 1]["step"]]
    trial.kills += killed
    trial.resumes += killed
    if not drops:  # the job ended before the kill, or the killed rank (and the others) had just checkpointed
        gen0 = to_gen(gen["world"], recs, None, s["epochs"])
        gen0.commit = (s["epochs"] - 1, END)
        return [gen0]
    resumed_at = min(drops) - 1  # the restarted ranks begin after the checkpoint's step
    first: dict[int, list] = {}
    second: dict[int, list] = {}
    for r, xs in recs.items():  # the restarted run: from the last record of the step after the checkpoint's
        begin = max((k for k, x in enumerate(xs) if x["step"] == resumed_at + 1), default=len(xs))
        first[r], second[r] = xs[:begin], xs[begin:]
    gen0 = to_gen(gen["world"], first, None, s["epochs"])
    gen0.batch = gen["batch"]
    _said_batches(gen0, folder / "run.out")
    keys = [k for xs in gen0.delivered.values() for k, _ in xs if k[1] == resumed_at]
    gen0.commit = keys[0] if keys else None
    gen1 = to_gen(gen["world"], second, gen0.commit, s["epochs"])
    gen1.batch, gen1.commit = gen["batch"], (s["epochs"] - 1, END)
    _said_batches(gen1, folder / "run.out")
    return [gen0, gen1]
