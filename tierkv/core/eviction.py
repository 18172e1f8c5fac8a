"""Eviction listeners: the store's public seam for code that wants a block's page when the
store lets go of its last local copy (the cluster node publishes it to the remote tier).

Placement calls :meth:`EvictionListeners.notify` with the store lock held, right before it
frees the slot of a block whose only copy is in the tier being evicted (after demotion and
write-back had their chance). The page is copied to the CPU then, while the slot is still
held, and only when some listener wants the block, so a store without listeners (or with
listeners that filter the block out) pays nothing. Listeners run under the store lock: they
must be quick and must not call the store (hand the page to a thread instead). A listener
that raises is logged and skipped: eviction must not fail because a listener did.

Rejected: wrapping the store's private ``_evict`` at run time (what ClusterNode used to
do): it broke silently whenever placement changed and hid the dependency from readers.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from .blocks import Block, Priority

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvictedBlock:
    """A block leaving this store, with a CPU copy of its page. ``checksum`` is the one
    recorded when the block was stored (a page damaged since then does not match it, so a
    reader elsewhere still rejects it)."""

    key: bytes
    parent: bytes
    model_version: str
    namespace: str
    tokens: bytes
    checksum: int
    priority: "Priority"
    tier: str  # the tier it was evicted from: its last local copy
    page: "torch.Tensor"


Listener = Callable[[EvictedBlock], None]
Wants = Callable[[str, "Priority"], bool]  # (namespace, priority) -> whether to copy the page


class EvictionListeners:
    """The listeners of one store. Adding and removing may happen from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: tuple[tuple[Listener, Wants | None], ...] = ()

    def add(self, fn: Listener, wants: Wants | None = None) -> None:
        """Call ``fn`` for every block that leaves the store's last local tier and that
        ``wants(namespace, priority)`` accepts (every block when None)."""
        with self._lock:
            self._listeners = (*self._listeners, (fn, wants))

    def remove(self, fn: Listener) -> None:
        with self._lock:
            self._listeners = tuple(entry for entry in self._listeners if entry[0] != fn)  # == : bound methods are new objects

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def notify(self, b: "Block", tier: str, read_page: Callable[[], "torch.Tensor"]) -> None:
        """Hand ``b`` (leaving its last tier, ``tier``) to the listeners that want it.
        ``read_page`` gives a CPU copy of its page; called at most once."""
        chosen = [fn for fn, wants in self._listeners if wants is None or wants(b.namespace, b.priority)]
        if not chosen:
            return
        try:
            page = read_page()
        except Exception as e:  # noqa: BLE001 - a failed copy costs the listeners this block only
            log.warning("evicted block %s not handed to listeners: %s", b.key.hex()[:12], e)
            return
        event = EvictedBlock(b.key, b.parent, b.model_version, b.namespace, bytes(b.tokens), b.checksum,
                             b.priority, tier, page)
        for fn in chosen:
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - see the module docstring
                log.exception("eviction listener %r failed", fn)
