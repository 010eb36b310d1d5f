"""The preemption fuzz (``make fuzz``): jobs SIGKILLed at random batches and resumed, checked epoch by epoch
against the promise of exact resume (docs/distributed.md).

Each trial draws a job: a data kind (ImageFolder, packed, local WebDataset shards, shards on moto's S3
server, Parquet read at random or streamed by row groups), a loader (DALIIterator or TorchIterator), a mode,
``drop_last``, ``even``, a controller, a resolution schedule. It runs the job as generations of rank processes:
each generation is killed (SIGKILL, rank by rank, each at its own batch: right after a batch, between a state
save and the next batch, or from outside while it runs) and the next resumes from the last state every rank
had saved, on a world size, batch size, number of workers, prefetch depth and way of naming its ranks
(arguments, or ``RANK``/``WORLD_SIZE``) drawn anew, each new rank loading the state of an old rank drawn at
random; the last generation runs to the end. The modes: `preemption_rank.run_rank` (the loaders as a
training loop drives them), `preemption_rank.run_lightning` (a Lightning fit, restored mid-epoch from its
checkpoint), and in `preemption_train`, ``dali-fast train --resume`` under torchrun, and torchrun's elastic
agent restarting a group one of whose ranks died (``--max-restarts``). `preemption_check` says what each
epoch must hold: nothing lost, no repeat beyond the padding the docs allow, the uninterrupted order wherever
the world size did not change, and an exact replay of the work a kill lost.

    python scripts/preemption_fuzz.py --trials 500 --seed 1     # make fuzz TRIALS=500 SEED=1
    python scripts/preemption_fuzz.py --quick                     # the slice make test runs

The last line: trials, kills, resumes, lost, repeated, order mismatches (and replay and pixel mismatches,
hung or failed processes); the exit status is 1 when any of those is not zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: rank processes are forked from this one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import preemption_rank as rk  # noqa: E402
from preemption_check import END, Gen, Verdict, check_trial  # noqa: E402

KINDS = ("folder", "packed", "wds", "s3", "parquet", "parquet-stream")
LOADERS = ("torch", "dali")
MODES = {"loader": 0.84, "lightning": 0.06, "train": 0.07, "restart": 0.03}  # how often each is drawn
GEN_TIMEOUT = 240.0  # seconds a generation may run before it counts as hung
LIVE: set[int] = set()  # rank processes forked and not yet waited for (each leads a process group)


@dataclass
class Trial:
    """A drawn job and its outcome."""

    index: int
    mode: str
    kind: str
    backend: str
    settings: dict[str, Any]
    kills: int = 0
    resumes: int = 0
    resized: int = 0
    pixels: int = 0
    failures: list[str] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)

    def line(self) -> str:
        s = self.settings
        flags = [k for k in ("drop_last", "controller", "progressive") if s.get(k)] + ([] if s["even"] else ["uneven"])
        worlds = "→".join(str(w) for w in s.get("worlds", []))
        state = "ok" if self.ok else "FAIL " + "; ".join((self.failures + self.verdict.notes)[:3])
        return (
            f"trial {self.index}: {self.mode} {self.kind} {self.backend} [{' '.join(flags)}] ranks {worlds}: "
            f"{self.kills} kills, {self.resumes} resumes: {state}"
        )

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.failures and not self.pixels


# ------------------------------------------------------------------------------------- processes


def fork(fn: Callable[[dict[str, Any]], None], job: dict[str, Any], folder: Path) -> int:
    """Run ``fn(job)`` in a child forked from here, in a process group of its own (killed whole), its
    output in ``folder``; exit status 0 when ``fn`` returns, 1 when it raises."""
    folder.mkdir(parents=True, exist_ok=True)
    out = os.open(folder / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid:
        os.close(out)
        LIVE.add(pid)
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        os.dup2(out, 1)
        os.dup2(out, 2)
        fn(job)
        code = 0
    except BaseException:  # noqa: BLE001 - the child reports and exits, never returns into the parent's loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def run_child(fn: Callable[[dict[str, Any]], None], job: dict[str, Any], folder: Path, timeout: float = 600) -> None:
    """``fn(job)`` in a forked child, waited for; its output is raised when it fails."""
    pid = fork(fn, job, folder)
    if wait_all([pid], timeout)[pid] != 0:
        raise RuntimeError(f"{fn.__name__} failed:\n{(folder / 'output.txt').read_text()[-3000:]}")


def wait_all(pids: list[int], timeout: float, poll: Callable[[], None] | None = None) -> dict[int, int | None]:
    """Each pid's exit status (negative: the signal that killed it; None: still running at the timeout, then
    killed), calling ``poll`` between checks."""
    status: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    while len(status) < len(pids):
        for pid in pids:
            if pid in status:
                continue
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = os.waitstatus_to_exitcode(raw)
                LIVE.discard(pid)
        if poll is not None:
            poll()
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in status:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status[pid] = None
                    LIVE.discard(pid)
        time.sleep(0.01)
    return status


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def moto_server(log: Path):
    """moto's S3 server in its own process (a thread here would not survive the forks); yields its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=sink, stderr=sink
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start; pip install 'moto[server]'")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------------- logs and states


def read_log(path: Path) -> tuple[list[tuple[tuple[int, int], list[int]]], dict[int, int], int, bool]:
    """(each batch's (key, ids) in order, each epoch's batch size, images that failed the check, done)."""
    delivered, batches, bad, done = [], {}, 0, False
    if not path.exists():
        return delivered, batches, bad, done
    for line in path.read_text().splitlines():
        try:
            x = json.loads(line)
        except json.JSONDecodeError:  # the last line of a rank killed while writing it
            continue
        if "ids" in x:
            delivered.append(((x["e"], x["k"]), x["ids"]))
            bad += x["bad"]
        elif "batch" in x:
            batches[x["epoch"]] = max(batches.get(x["epoch"], 0), x["batch"])
        done = done or bool(x.get("done"))
    return delivered, batches, bad, done


def batches_logged(path: Path) -> int:
    try:
        return path.read_bytes().count(b'"ids"')
    except OSError:
        return 0


def saved_keys(folder: Path) -> dict[tuple[int, int], Path]:
    out = {}
    for f in folder.glob("state-*.json"):
        _, epoch, key = f.stem.split("-")
        out[(int(epoch), int(key))] = f
    return out


# ---------------------------------------------------------------------------------------- the draw


def draw(rng: np.random.Generator, index: int, kinds: tuple[str, ...], modes: dict[str, float]) -> Trial:
    names = list(modes)
    mode = names[rng.choice(len(names), p=np.array(list(modes.values())) / sum(modes.values()))]
    streamed_only_by_the_api = mode in ("train", "restart") and len(kinds) > 1  # the command opens Parquet its way
    kind = str(rng.choice([k for k in kinds if not (streamed_only_by_the_api and k == "parquet-stream")]))
    backend = str(rng.choice(LOADERS))
    drop_last = bool(rng.random() < 0.25)
    settings = {
        "seed": int(rng.integers(1000)),
        "epochs": int(rng.integers(2, 4)),
        "drop_last": drop_last,
        "even": bool(drop_last or rng.random() < 0.8),
        "controller": bool(rng.random() < 0.15),
        "progressive": bool(rng.random() < 0.15),
        "uint8": bool(rng.random() < 0.5),
        "save_every": int(rng.integers(1, 4)),
        "pattern": [float(x) for x in rng.choice([0.2, 0.5, 0.95], size=4)],
    }
    if mode in ("train", "restart"):  # what train does: equal shares, the tail cut (BatchNorm meets no batch of 1)
        settings.update(even=True, drop_last=True)
    return Trial(index, mode, kind, backend, settings)


def draw_gen(rng: np.random.Generator, trial: Trial, previous: int | None) -> dict[str, Any]:
    """A generation's world size (half the time the previous one), batch size, workers, prefetch, naming."""
    top = 4 if trial.mode == "loader" else 3
    world = previous if previous is not None and rng.random() < 0.5 else int(rng.integers(1, top + 1))
    return {
        "world": int(world),
        "batch": int(rng.integers(2, 7)),
        "workers": int(rng.choice([0, 0, 1, 2])),
        "threads": int(rng.integers(1, 3)),
        "prefetch": int(rng.integers(1, 4)),
        "naming": str(rng.choice(["args", "env"])),
        "resume_batch": bool(rng.random() < 0.4),
    }


# ------------------------------------------------------------------------------- the loader modes


def run_generations(trial: Trial, rng: np.random.Generator, env: dict[str, Any], folder: Path) -> list[Gen]:
    """The generations of a loader or Lightning trial, until one runs to the end; their `Gen`s."""
    s, lightning = trial.settings, trial.mode == "lightning"
    gens: list[Gen] = []
    checkpoint: list[Path] | None = None  # the states (one per rank) the next generation resumes from
    equal = True  # whether they are at one position (else each rank resumes from its own, or rank 0's)
    start: tuple[int, int] | None = None
    previous = None
    kills_left = int(rng.integers(1, 4))
    for g in range(8):
        gen = draw_gen(rng, trial, previous)
        if lightning:  # one process; the batch size of the checkpoint (Lightning counts batches: `resume`)
            gen.update(world=1, naming="args", batch=gens[0].batches.get(0, gen["batch"]) if gens else gen["batch"])
        world = gen["world"]
        trial.resized += previous is not None and world != previous
        per_epoch = math.ceil(math.ceil(env["layout"]["n"] / world) / gen["batch"])  # batches per epoch and rank
        left = per_epoch * s["epochs"] - (0 if start is None else per_epoch * start[0])
        last = kills_left == 0 or g == 7
        target = int(rng.integers(1, max(2, left + 1)))
        jobs, pids, external = [], [], {}
        for r in range(world):
            job = {**s, **gen, "rank": r, "kind": trial.kind, "backend": trial.backend, "data": str(env["data"])}
            job.update(endpoint=env["endpoint"], cache=str(folder / "s3-cache"), out=str(folder / f"g{g}" / f"r{r}"))
            source = None if checkpoint is None else checkpoint[_source(rng, len(checkpoint), r, world, equal)]
            job["state" if not lightning else "ckpt"] = None if source is None else str(source)
            job["resume_batch"] = gen["batch"] if gen["resume_batch"] and source is not None else None
            how = str(rng.choice(["batch", "save", "outside"]))
            at = max(1, target + int(rng.integers(-1, 2)))
            job["kill"] = None if last or how == "outside" else [how, at]
            if not last and how == "outside":
                external[r] = at
            Path(job["out"]).mkdir(parents=True)
            jobs.append(job)
            pids.append(fork(rk.run_lightning if lightning else rk.run_rank, job, Path(job["out"])))

        def poll(pids=pids, jobs=jobs, external=external) -> None:
            for r, at in list(external.items()):
                if batches_logged(Path(jobs[r]["out"]) / "log.jsonl") >= at:
                    kill_group(pids[r])
                    del external[r]

        status = wait_all(pids, GEN_TIMEOUT, poll)
        logs = [read_log(Path(j["out"]) / "log.jsonl") for j in jobs]
        for r, pid in enumerate(pids):
            code = status[pid]
            trial.pixels += logs[r][2]
            if code is None:
                trial.failures.append(f"generation {g} rank {r} hung (killed after {GEN_TIMEOUT:.0f} s)")
            elif code == -signal.SIGKILL and not last:
                trial.kills += 1
            elif code != 0:
                output = (Path(jobs[r]["out"]) / "output.txt").read_text()[-1500:]
                trial.failures.append(f"generation {g} rank {r} exited with {code}: {output}")
        done = all(log[3] for log in logs)
        gen_record = Gen(world, {r: logs[r][0] for r in range(world)}, start, batch=gen["batch"])
        gen_record.batches = {e: max(log[1].get(e, 0) for log in logs) for e in range(s["epochs"])}
        gen_record.batches = {e: b for e, b in gen_record.batches.items() if b}
        if trial.failures:
            gens.append(gen_record)
            return gens
        if lightning:
            commit, checkpoint = _lightning_commit(folder / f"g{g}" / "r0", logs[0][0], start, checkpoint)
        else:
            commit, checkpoint, equal = _commit([Path(j["out"]) for j in jobs], checkpoint, equal)
        gen_record.commit = (s["epochs"] - 1, END) if done else commit
        gens.append(gen_record)
        s.setdefault("worlds", []).append(world)
        if done:
            return gens
        trial.resumes += 1
        kills_left -= 1
        start = gen_record.commit if gen_record.commit is not None else start
        previous = world
    trial.failures.append("no generation ran to the end in 8")
    return gens


def _commit(ranks: list[Path], previous: list[Path] | None, equal: bool) -> tuple[Any, Any, bool]:
    """The last key every rank saved a state at, those states, and whether they are at one position; the
    previous ones when there is no such key."""
    keys = [saved_keys(r) for r in ranks]
    common = set(keys[0]).intersection(*keys[1:])
    if not common:
        return None, previous, equal
    key = max(common)
    states = [k[key] for k in keys]
    positions = {json.loads(p.read_text())["loader"]["sampler"]["position"] for p in states}
    return key, states, len(positions) == 1


def _source(rng: np.random.Generator, saved: int, rank: int, world: int, equal: bool) -> int:
    """Which old rank's state new rank ``rank`` loads: any, in a lockstep run (all at one position); else
    (uneven shares at an epoch's end) its own on the same world size, rank 0's (the longest share) on another."""
    if equal:
        return int(rng.integers(saved))
    return rank if saved == world else 0


def _lightning_commit(rank: Path, delivered: list, start: Any, previous: Any) -> tuple[Any, Any]:
    """The global step in ``last.ckpt`` (and its key), and the checkpoint, when this run wrote one."""
    import torch

    ckpt = rank / "ck" / "last.ckpt"
    if not ckpt.exists():
        return None, previous
    step = int(torch.load(ckpt, weights_only=True, map_location="cpu")["global_step"])
    keys = [k for k, _ in delivered if k[1] == step]
    if not keys:
        return None, previous
    kept = rank.parent / f"last-{step}.ckpt"
    shutil.copy(ckpt, kept)  # the next run writes its own into its own folder
    return keys[0], [kept]


def order_of(layout: dict[str, Any], trial: Trial) -> Callable[[int, int, int], list[int]]:
    """The uninterrupted order of a rank, from the library's order objects (a pure function of the seed,
    epoch, rank and world size)."""
    from dali_fast.loaders.order import EpochSampler, StreamingOrder

    s = trial.settings
    kw = {"seed": s["seed"], "shuffle": True, "drop_last": s["drop_last"], "even": s["even"]}

    def order(world: int, rank: int, epoch: int) -> list[int]:
        if layout["bounds"] is not None:
            o = StreamingOrder(layout["bounds"], window=layout["window"], rank=rank, world_size=world, **kw)
        else:
            o = EpochSampler(layout["n"], rank=rank, world_size=world, **kw)
        return [int(layout["ids"][i]) for i in o.indices(epoch)] if "ids" in layout else o.indices(epoch).tolist()

    return order


def run_trial(trial: Trial, rng: np.random.Generator, envs: dict[str, Any], folder: Path) -> Trial:
    if trial.mode in ("train", "restart"):
        import preemption_train

        try:
            gens, layout = preemption_train.run(trial, rng, envs[trial.kind], folder)
        except RuntimeError as e:
            trial.failures.append(str(e))
            return trial
    else:
        layout = envs[trial.kind]["layout"]
        gens = run_generations(trial, rng, envs[trial.kind], folder)
    if trial.failures:
        return trial
    s = trial.settings
    universe = layout.get("ids", range(layout["n"]))
    trial.verdict = check_trial(
        gens, s["epochs"], list(universe), order_of(layout, trial), drop_last=s["drop_last"], even=s["even"]
    )
    return trial


# ---------------------------------------------------------------------------------------------- main


QUICK = [  # the slice make test runs: (mode, kind, backend, settings changed)
    ("loader", "folder", "torch", {}),
    ("loader", "packed", "dali", {"drop_last": True, "even": True}),
    ("loader", "wds", "torch", {"controller": True}),
    ("loader", "parquet-stream", "dali", {}),
    ("loader", "parquet", "torch", {"even": False, "drop_last": False}),
    ("loader", "s3", "dali", {"progressive": True}),
    ("loader", "parquet-stream", "torch", {"drop_last": True, "even": True}),
    ("loader", "s3", "torch", {}),
    ("lightning", "packed", "torch", {}),
]


def setup(out: Path, kinds: tuple[str, ...], stack: contextlib.ExitStack) -> dict[str, Any]:
    """The data of every kind, moto's server when a kind needs it, and each kind's layout."""
    data = out / "data"
    data.mkdir(parents=True)
    run_child(lambda job: rk.build(data), {}, out / "setup")
    endpoint = None
    if "s3" in kinds:
        for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        endpoint = stack.enter_context(moto_server(out / "moto.log"))
        run_child(lambda job: rk.upload(data, endpoint), {}, out / "setup")
    envs = {}
    for kind in kinds:
        path = out / "setup" / f"{kind}.json"
        run_child(
            lambda job, kind=kind, path=path: path.write_text(json.dumps(rk.layout(kind, data, endpoint))),
            {},
            out / "setup",
        )
        envs[kind] = {"data": data, "endpoint": endpoint, "layout": json.loads(path.read_text()), "kind": kind}
    return envs


def fuzz(
    trials: int,
    seed: int,
    out: Path,
    quick: bool,
    kinds: tuple[str, ...],
    modes: dict[str, float],
    verbose: bool,
    only: set[int] | None = None,
) -> list[Trial]:
    rng = np.random.default_rng(seed)
    done: list[Trial] = []
    with contextlib.ExitStack() as stack:
        envs = setup(out, kinds, stack)
        for t in range(len(QUICK) if quick else trials):
            trial = draw(rng, t, kinds, modes)  # drawn for every trial, so a trial is the same run alone
            if only is not None and t not in only:
                continue
            if quick:
                trial.mode, trial.kind, trial.backend = QUICK[t][:3]
                trial.settings.update(QUICK[t][3])
            folder = out / f"trial{t:04d}"
            trial = run_trial(trial, np.random.default_rng([seed, t]), envs, folder)
            done.append(trial)
            if verbose or not trial.ok:
                print(trial.line(), flush=True)
            if trial.ok:
                shutil.rmtree(folder, ignore_errors=True)
    return done


def summary(done: list[Trial], seed: int) -> str:
    v = Verdict()
    for t in done:
        v.add(t.verdict)
    covered = lambda attr: ",".join(sorted({getattr(t, attr) for t in done}))  # noqa: E731
    flags = Counter(k for t in done for k in ("drop_last", "controller", "progressive") if t.settings.get(k))
    flags["uneven"] = sum(not t.settings["even"] for t in done)
    return (
        f"preemption fuzz, seed {seed}: {len(done)} trials, {sum(t.kills for t in done)} kills, "
        f"{sum(t.resumes for t in done)} resumes ({sum(t.resized for t in done)} changed the world size), "
        f"{v.lost} lost, {v.repeated} repeated, {v.order} order mismatches (of {v.orders_checked} rank epochs), "
        f"{v.replay} replay mismatches (of {v.replays_checked}), "
        f"{sum(t.pixels for t in done)} pixel mismatches, {sum(bool(t.failures) for t in done)} failed trials; "
        f"modes {covered('mode')}; kinds {covered('kind')}; loaders {covered('backend')}; "
        f"with {', '.join(f'{k} {n}' for k, n in sorted(flags.items()))}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the fixed slice make test runs (--trials ignored)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated data kinds")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    ap.add_argument("--out", default=None, help="where trials run (default: a temporary folder); failed ones stay")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per trial, not only the failed ones")
    ap.add_argument("--only", default=None, help="comma-separated trial numbers to run (the same seed's trials)")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    modes = {m: MODES[m] for m in args.modes.split(",") if m}
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="preemption-fuzz-"))
    if args.out:
        shutil.rmtree(out, ignore_errors=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: moto's server and the ranks go too
    started = time.monotonic()
    only = {int(t) for t in args.only.split(",")} if args.only else None
    try:
        done = fuzz(args.trials, args.seed, out, args.quick, kinds, modes, args.verbose, only)
    finally:
        for pid in list(LIVE):
            kill_group(pid)
    line = summary(done, args.seed)
    print(f"{line} ({time.monotonic() - started:.0f} s)")
    ok = all(t.ok for t in done)
    if ok and not args.out:
        shutil.rmtree(out, ignore_errors=True)
    elif not ok:
        print(f"failed trials kept in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
