"""The memory bench reports: the PSS of the main process and every process under it, other rows' left out."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dali_fast.tools.tree_memory import TreeMemory, descendants, pss_bytes, tree_pss

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux's smaps_rollup")

HOLD = "import sys, time; b = bytearray(80 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(60)"


def hold_80_mib() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_the_tree_counts_a_child_and_leaves_out_what_it_is_told():
    child = hold_80_mib()
    try:
        me = os.getpid()
        assert child.pid in descendants(me)
        own = pss_bytes(child.pid)
        assert own is not None and own > 80 * 2**20  # the 80 MiB it touched, and its interpreter's share
        with_child, without = tree_pss(me), tree_pss(me, exclude=[child.pid])
        assert abs((with_child - without) - own) < 4 * 2**20
        assert without == pytest.approx(tree_pss(me, exclude=[child.pid]), abs=4 * 2**20)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in descendants(os.getpid())


def test_a_phase_keeps_its_peak_and_one_reading_at_its_start():
    memory = TreeMemory(interval=0.05)
    assert memory.peak("row") is None and memory.read_now() is None  # outside a phase: nothing
    with memory.phase("row"):
        child = hold_80_mib()
        time.sleep(0.2)
        memory.read_now()
        child.kill()
        child.wait()
    assert memory.peak("row") > pss_bytes(os.getpid()) + 80 * 2**20
    child = hold_80_mib()
    try:
        with memory.phase("other", exclude=[child.pid]):
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()
    assert memory.peak("other") < memory.peak("row") - 60 * 2**20
