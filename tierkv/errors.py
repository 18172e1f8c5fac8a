"""Typed errors: one root, one subclass per condition a caller can act on.

Every error carries a hint that says what to do about it; `str(err)` includes it.
"""
from __future__ import annotations


class TierKVError(Exception):
    """Root of every error tierkv raises on purpose."""

    default_hint = ""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message


class InvalidTokensError(TierKVError, ValueError):
    default_hint = "token ids must be integers in [0, 2**31) given as a 1-D sequence"


class PageFormatError(TierKVError, ValueError):
    default_hint = "pages must be [n_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in the store's dtype"


class LayoutMismatchError(TierKVError):
    default_hint = "open the home with the layout it was created with, or use another --home"


class ConfigError(TierKVError, ValueError):
    default_hint = "check the capacities and options passed to tierkv.open()"


class StoreLockedError(TierKVError):
    default_hint = "close the other process, or connect to its daemon with --socket"


class DaemonOwnsHomeError(StoreLockedError):
    default_hint = "pass --socket PATH (or tierkv.connect(PATH)) to go through the running daemon"


class ForkedStoreError(TierKVError):
    default_hint = "a store cannot be used across fork(); open it again in the child (use the 'spawn' start method)"


class DiskWriteError(TierKVError):
    default_hint = "the disk tier is marked degraded; free space or fix the device, the store keeps serving from memory"


class IndexFullError(TierKVError):
    default_hint = "raise index_map_bytes (--index-map-size) or run `tierkv gc`"


class LeaseError(TierKVError):
    default_hint = "use a lease only between acquire() and release(), from the store that issued it"


class CapacityError(TierKVError):
    default_hint = "raise the tier capacity or ask for fewer blocks at once"


class NotFoundError(TierKVError):
    default_hint = "list what exists with `tierkv ls`"


class ModelVersionMismatchError(TierKVError):
    default_hint = "materialise the prefix again for this model, or pass the model it was made with"


class ProtocolError(TierKVError):
    default_hint = "client and daemon must speak the same protocol version; upgrade the older side"


class DaemonUnavailableError(TierKVError):
    default_hint = "start it with `tierkv serve`, or check the --socket path"
