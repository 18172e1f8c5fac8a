"""Priority classes of stored blocks: the order in which eviction takes them."""
from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    """Eviction classes: ephemeral goes first (and is dropped when its lease ends),
    pinned never goes."""

    EPHEMERAL = 0
    NORMAL = 1
    PINNED = 2


# The members as module constants, for per-block paths (a victim check, the release of each
# leased block): on Python 3.11 the enum's class has a __getattr__, so every
# ``Priority.PINNED`` is a slow attribute lookup (52 ns against 15 ns for an attribute of a
# plain class, timeit).
EPHEMERAL, NORMAL, PINNED = Priority.EPHEMERAL, Priority.NORMAL, Priority.PINNED
