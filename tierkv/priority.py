"""Priority classes of stored blocks: the order in which eviction takes them."""
from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    """Eviction classes: ephemeral goes first (and is dropped when its lease ends),
    pinned never goes."""

    EPHEMERAL = 0
    NORMAL = 1
    PINNED = 2
