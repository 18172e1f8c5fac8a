"""Storage tiers: fixed-capacity pools of page slots (device, host, disk)."""
from .base import SlotAllocator, TierName
from .disk import DiskTier
from .memory import MemoryTier

__all__ = ["DiskTier", "MemoryTier", "SlotAllocator", "TierName"]
