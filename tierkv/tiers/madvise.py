"""libc's ``madvise`` through ctypes (Python's ``mmap.madvise`` wants the mmap object and
an offset; the tiers hold addresses of tensors), and the advice values tierkv uses.

ctypes drops the GIL around each call, so a long ``MADV_POPULATE_WRITE`` on a helper thread
does not stall the others.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable

MADV_REMOVE = 9
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and (4 KiB base pages) arm64


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(addr, length, advice) -> 0 or -1 (errno through ctypes), or None where
    unavailable."""
    try:
        madvise: Any = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise  # type: ignore[no-any-return]


def advise(addr: int, nbytes: int, advice: int) -> bool:
    """``madvise(addr, nbytes, advice)``; False when refused or unavailable (every advice
    tierkv gives is an optimisation or a give-back, never needed for correctness)."""
    madvise = libc_madvise()
    return madvise is not None and nbytes > 0 and madvise(addr, nbytes, advice) == 0


def errno_now() -> int:
    return ctypes.get_errno()
