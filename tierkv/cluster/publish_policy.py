"""What a node publishes to the remote tier, and when.

Defaults: write-through for pinned and materialised prefixes (the pages every node will
want), nothing else. ``publish_puts`` also publishes every normal put; ``write_back_evicted``
publishes blocks as they leave this node's last tier (needs the store's eviction hook, see
docs/cluster.md); namespaces in ``local_only_namespaces`` never leave the node.
Ephemeral blocks are never published. Rejected: publishing every put by default (it would
push each request's private suffix to the cluster and evict shared prefixes).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..blocks import Priority


class Event(str, Enum):
    PUT = "put"  # pages stored on this node
    PINNED = "pinned"  # a cached prefix raised to PINNED
    MATERIALISED = "materialised"  # a named prefix recorded (save_manifest)
    EVICTED = "evicted"  # a block left this node's last tier


@dataclass(frozen=True)
class PublishPolicy:
    publish_pinned: bool = True
    publish_materialised: bool = True
    publish_puts: bool = False
    write_back_evicted: bool = False
    local_only_namespaces: frozenset[str] = frozenset()
    promote_priority: Priority = Priority.NORMAL  # priority of pages fetched from the remote tier

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_only_namespaces", frozenset(self.local_only_namespaces))
        if not all(isinstance(n, str) and n for n in self.local_only_namespaces):
            raise ValueError("local_only_namespaces must hold non-empty strings")
        if not isinstance(self.promote_priority, Priority):
            raise ValueError("promote_priority must be a Priority")

    def wants(self, event: Event, namespace: str, priority: Priority = Priority.NORMAL) -> bool:
        """Whether blocks of ``namespace`` (at ``priority``) are published on ``event``."""
        if namespace in self.local_only_namespaces or priority == Priority.EPHEMERAL:
            return False
        if event == Event.PUT:
            return self.publish_puts or (self.publish_pinned and priority == Priority.PINNED)
        if event == Event.PINNED:
            return self.publish_pinned
        if event == Event.MATERIALISED:
            return self.publish_materialised
        return self.write_back_evicted

    def fetches(self, namespace: str) -> bool:
        """Whether a node looks in the remote tier for ``namespace`` at all."""
        return namespace not in self.local_only_namespaces
