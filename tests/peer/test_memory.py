"""release_large_frees: a big block freed goes back to the system, even after glibc raised its threshold."""

import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, sys
from phalanx.peer.memory import release_large_frees

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "on":
    assert release_large_frees()
libc.free(libc.malloc(8 << 20))  # glibc's own rule: freeing an mmapped 8 MiB block raises its threshold to 8 MiB
before = libc.mallinfo2().hblkhd
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd - before)  # bytes of the 2 MiB block that came from mmap (freed to the system)
libc.free(block)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_large_block_comes_from_mmap_after_release_large_frees():
    def mmapped(setting: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert mmapped("off") == 0  # without it the 2 MiB block stays in the heap, and so does its memory once freed
    assert mmapped("on") >= 2 << 20
