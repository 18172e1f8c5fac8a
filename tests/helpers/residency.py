"""How much of a memory range is resident (``mincore``: exact for any range, where
/proc/self/smaps reports whole mappings and the kernel merges adjacent anonymous mappings
into one), and the smaps fields of the mapping that holds an address."""
from __future__ import annotations

import ctypes
import mmap

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(addr: int, nbytes: int) -> int:
    """Bytes of the pages of ``[addr, addr + nbytes)`` (whole pages) that are resident."""
    page = mmap.PAGESIZE
    lo = addr // page * page
    n_pages = -(-(addr + nbytes - lo) // page)
    vec = (ctypes.c_ubyte * n_pages)()
    if _libc.mincore(lo, n_pages * page, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page


def vma_fields(addr: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB: ``Rss``, ``AnonHugePages`` ...) of the mapping that
    holds ``addr`` (with whatever neighbours the kernel merged into it)."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields
