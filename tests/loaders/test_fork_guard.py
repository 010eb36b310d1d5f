"""Fork safety: a worker forked while a loader awaits collection never tears down the parent's DALI pipeline
or worker pool (`fork_guard`), and a pass never waits forever on a decode worker that died or is stuck
(`torch_watch`)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from builders import IndexReader, jpeg_bytes
from contract import each_once

from dali_fast import TorchIterator
from dali_fast.loaders import fork_guard, torch_watch

ROOT = Path(__file__).resolve().parents[2]

# The parent keeps a DALIIterator's pipeline (a pass ended normally), drops the iterator into a reference
# cycle with the collector off, so it awaits collection when TorchIterator forks its workers; each worker
# then runs the collector first thing, as a busy worker's own collector would. Many rounds.
FORKED_WHILE_A_PIPELINE_AWAITS_COLLECTION = """
import gc, sys
sys.path.insert(0, "tests/helpers")
from builders import IndexReader, jpeg_bytes
from contract import each_once
import dali_fast.loaders.torch_iterator as ti
from dali_fast import DALIIterator, TorchIterator

real = ti.worker_init
def collect_first(worker_id):
    real(worker_id)
    gc.collect()
ti.worker_init = collect_first
reader = IndexReader([jpeg_bytes(32 + i % 5, 24 + i % 3) for i in range(37)])
for round in range(ROUNDS):
    dali = DALIIterator(reader, 6, image_size=16, device="cpu", num_threads=2)
    for _ in dali:
        pass
    assert dali._kept is not None
    dali.cycle = dali
    gc.disable()
    del dali
    loader = TorchIterator(reader, 6, image_size=16, device="cpu", num_workers=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        each_once([i for _ in loader for i in loader.last_indices.tolist()], range(37))
    loader.close()
    gc.enable()
    gc.collect()  # the parent collects its own iterator, and shuts its pipeline down, as before
again = DALIIterator(reader, 6, image_size=16, device="cpu", num_threads=2)
each_once([i for _ in again for i in again.last_indices.tolist()], range(37))
print("rounds done:", ROUNDS)
"""


def test_workers_forked_while_a_dali_pipeline_awaits_collection_leave_it_alone():
    """Before the guard, a worker's collector shut the parent's pipeline down in the child: the worker died
    (a segmentation fault, or "Fatal Python error: Aborted" in DALI's ``_shutdown``) or hung the pass."""
    pytest.importorskip("nvidia.dali")
    rounds = 6
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKED_WHILE_A_PIPELINE_AWAITS_COLLECTION.replace("ROUNDS", str(rounds))],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=180)  # about 15 s; a hung worker hung the pass for good
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers too
        proc.communicate()
        pytest.fail("the pass hung on a worker")
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[-1] == f"rounds done: {rounds}"
    assert "Fatal Python error" not in err


def test_a_forked_child_never_stops_the_worker_pool_of_a_loader_awaiting_collection(index_reader, monkeypatch):
    """A TorchIterator whose pool is up awaits collection while another forks its workers, whose collector
    runs: before the guard, the child's ``close()`` told the first pool's workers to exit."""
    import dali_fast.loaders.torch_iterator as ti

    real = ti.worker_init
    monkeypatch.setattr(ti, "worker_init", lambda worker_id: (real(worker_id), gc.collect()))
    first = TorchIterator(index_reader, 6, image_size=16, device="cpu", num_workers=2)
    for _ in first:
        pass
    workers = list(first._loader._iterator._workers)  # noqa: SLF001 - the pool the child must leave alone
    first.cycle = first
    gc.disable()
    try:
        del first
        second = TorchIterator(index_reader, 6, image_size=16, device="cpu", num_workers=2)
        each_once([i for _ in second for i in second.last_indices.tolist()], range(37))
        second.close()
        for w in workers:
            w.join(timeout=1.0)  # an exit the child caused would come now
        assert all(w.is_alive() for w in workers)
    finally:
        gc.enable()
        gc.collect()
    for w in workers:
        w.join(timeout=30)
    assert not any(w.is_alive() for w in workers)  # collected in the parent: its pool is shut down there


class _Owner:
    def __init__(self):
        self.pool, self.other = ["the parent's"], ["not held"]


def test_hold_takes_the_attributes_away_in_a_forked_child_only():
    owner = _Owner()
    fork_guard.hold(owner, "pool")
    fork_guard.hold(owner, "pool", "missing")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's clean-up
        ok = owner.pool is None and owner.other == ["not held"] and ["the parent's"] in fork_guard.inherited()
        os.write(write, b"ok" if ok else b"no")
        os._exit(0)
    os.close(write)
    said = os.read(read, 2)
    os.close(read)
    os.waitpid(pid, 0)
    assert said == b"ok"
    assert owner.pool == ["the parent's"] and fork_guard.inherited() == []  # the parent keeps its own


class _HangingReader(IndexReader):
    """Record 5 blocks for ever (no CPU used) in a process other than the one that made the reader, while
    ``flag`` exists."""

    def __init__(self, items, flag: Path):
        super().__init__(items)
        self.parent, self.flag = os.getpid(), flag

    def __getitem__(self, i):
        if i == 5 and os.getpid() != self.parent and self.flag.exists():
            read_record_five_hangs()
        return super().__getitem__(i)


def read_record_five_hangs():
    threading.Event().wait()


def test_a_stuck_worker_is_named_with_its_stack_and_killed_and_the_next_pass_works(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(torch_watch.STUCK_ENV, "1.5")
    flag = tmp_path / "hang"
    flag.touch()
    reader = _HangingReader([jpeg_bytes(20 + i % 5, 18) for i in range(12)], flag)
    loader = TorchIterator(reader, 4, image_size=16, num_workers=2, device="cpu", seed=1)
    with pytest.raises(RuntimeError) as e:
        for _ in loader:
            pass
    pid = str(e.value).split("(pid ")[1].split(")")[0]
    assert str(e.value) == (
        f"DataLoader worker (pid {pid}) is stuck: it held a task for 1.5 s without using the CPU; its Python "
        f"stack is on stderr, and it was killed (set {torch_watch.STUCK_ENV} to wait longer); the next pass "
        "starts a new worker pool"
    )
    assert "in read_record_five_hangs" in capfd.readouterr().err
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    flag.unlink()
    loader.set_epoch(1)
    each_once([i for _ in loader for i in loader.last_indices.tolist()], range(12))
    loader.close()


class _QuitReader(IndexReader):
    def __init__(self, items):
        super().__init__(items)
        self.parent = os.getpid()

    def __getitem__(self, i):
        if i == 5 and os.getpid() != self.parent:
            os._exit(0)  # a quiet exit: no signal for DataLoader's handler to see
        return super().__getitem__(i)


def test_a_worker_that_exits_quietly_ends_the_pass_naming_it():
    loader = TorchIterator(_QuitReader([jpeg_bytes(20, 18)] * 12), 4, image_size=16, num_workers=1, device="cpu")
    with pytest.raises(RuntimeError, match=r"^a DataLoader worker died during this pass \(DataLoader worker \(pid"):
        for _ in loader:
            pass
    loader.close()


@pytest.mark.parametrize(("text", "said"), [("0", "a number of seconds above 0"), ("soon", "a number of seconds")])
def test_the_stuck_limit_is_checked_in_one_line(monkeypatch, text, said):
    monkeypatch.setenv(torch_watch.STUCK_ENV, text)
    with pytest.raises(ValueError) as e:
        torch_watch.stuck_seconds()
    assert str(e.value) == f"{torch_watch.STUCK_ENV}={text!r}: must be {said}"
    monkeypatch.setenv(torch_watch.STUCK_ENV, "2.5")
    assert torch_watch.stuck_seconds() == 2.5
    monkeypatch.delenv(torch_watch.STUCK_ENV)
    assert torch_watch.stuck_seconds() == torch_watch.STUCK_DEFAULT_S == 120.0


def test_the_watch_names_only_a_busy_worker_whose_cpu_time_stands_still():
    class Proc:
        def __init__(self, pid):
            self.pid = pid

    sleeper = subprocess.Popen(["sleep", "60"])  # uses no CPU while it sleeps
    try:
        still, gone = Proc(sleeper.pid), Proc(2**22 + 7)  # one that does not exist: no CPU reading
        watch = torch_watch._Watch(10.0)  # noqa: SLF001
        assert watch.stuck([still, gone], 0.0) is None
        assert watch.stuck([still, gone], 9.0) is None
        assert watch.stuck([still, gone], 10.0) is still  # unchanged for the limit
        assert watch.stuck([gone], 100.0) is None  # never named without a reading
        watch.seen[still.pid] = (-1, 0.0)  # it moved since: the clock restarts
        assert watch.stuck([still], 50.0) is None and watch.seen[still.pid][1] == 50.0
        assert watch.stuck([], 60.0) is None and watch.seen == {}  # no longer busy: forgotten
    finally:
        sleeper.kill()
        sleeper.wait()
