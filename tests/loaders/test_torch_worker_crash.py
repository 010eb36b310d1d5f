"""A decode worker that crashes in native code (a segmentation fault) ends the pass with DataLoader's error,
and its Python stack is on stderr, naming where it crashed, not only the signal."""

from __future__ import annotations

import ctypes
import os

import pytest
from builders import IndexReader, jpeg_bytes

from dali_fast import TorchIterator


class CrashingReader(IndexReader):
    """Record 5 crashes the process that reads it, when that is not the process that made the reader."""

    def __init__(self, items):
        super().__init__(items)
        self.parent = os.getpid()

    def __getitem__(self, i):
        if i == 5 and os.getpid() != self.parent:
            read_record_five_crashes()
        return super().__getitem__(i)


def read_record_five_crashes():
    ctypes.string_at(0)  # a read of address 0: SIGSEGV


def test_a_worker_that_segfaults_ends_the_pass_and_names_its_stack(capfd):
    reader = CrashingReader([jpeg_bytes(20 + i % 5, 18) for i in range(12)])
    loader = TorchIterator(reader, 4, image_size=16, num_workers=1, device="cpu")
    with pytest.raises(RuntimeError, match=r"^a DataLoader worker died during this pass \(DataLoader worker \(pid"):
        for _ in loader:
            pass
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err
    assert "in read_record_five_crashes" in err
    loader.close()
