"""glibc's heap, seen from a fresh process: is a large allocation mapped on its own (what `tame_malloc`
fixes) or carved from the heap (glibc's moving threshold)? Settings are per process, so each probe runs
in a new interpreter."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_PROBE = """
import ctypes
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SETUP
big = libc.malloc(16 << 20)
libc.free(big)  # glibc's own rule: the threshold rises to 16 MiB after this free
before = libc.mallinfo2().hblkhd
p = libc.malloc(6 << 20)
print("mapped" if libc.mallinfo2().hblkhd - before >= 6 << 20 else "heap")
"""


def large_allocation_after_free(setup: str = "", env: dict[str, str] | None = None) -> str:
    """Run ``setup`` in a fresh interpreter, then free a 16 MiB buffer and allocate 6 MiB: "mapped" when
    the 6 MiB got a mapping of its own, "heap" when it came from the heap."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.replace("SETUP", setup)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]
