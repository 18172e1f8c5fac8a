"""Holds on stored blocks: leases (a reader owns the pages) and busy counts (I/O in flight).

:class:`Holds` is a part of :class:`tierkv.core.blocks.BlockTable`, which owns one as
``table.holds`` (composition, issue #32: no class shares state through a base class). It
keeps no state of its own: the counts live on each block, where the table's victim search
reads them, and only these methods change them; so the part needs nothing passed in, and a
call through ``table.holds`` costs one attribute load more than the mixin's did, no
allocation. Paired and asserting: a count never goes below zero, and a caller cannot forget
the second half of a pair inside a scope (``held``). "Unheld" (what ``unlease`` and ``unbusy`` return) means no lease and no
I/O: a dead block may then be freed by its owner. The table's victim search never returns a
held block.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ..errors import LeaseError
from .priority import EPHEMERAL
from ..tiers.base import TIER_KEY, TierName

if TYPE_CHECKING:
    from .blocks import Block


class Holds:
    """Lease and busy counts of the table's blocks (see the module docstring): one per
    :class:`tierkv.core.blocks.BlockTable`, as its ``holds``."""

    @staticmethod
    def lease(block: Block) -> None:
        block.leases += 1

    @staticmethod
    def unlease(block: Block) -> bool:
        """Drop one lease of ``block``; returns whether nothing holds it any more."""
        assert block.leases > 0, f"block {block.key.hex()[:12]} released more often than leased"
        block.leases -= 1
        return not block.leases and not block.busy

    @staticmethod
    def busy(block: Block) -> None:
        block.busy += 1

    @staticmethod
    def unbusy(block: Block) -> bool:
        """End one in-flight I/O on ``block``; returns whether nothing holds it any more."""
        assert block.busy > 0, f"block {block.key.hex()[:12]}: busy count below zero"
        block.busy -= 1
        return not block.leases and not block.busy

    @contextlib.contextmanager
    def held(self, blocks: Iterable[Block], on_unheld: Callable[[Block], None] | None = None) -> Iterator[list[Block]]:
        """Keep ``blocks`` busy (never a victim) for the scope; every one is released even
        when the body raises, and ``on_unheld(b)`` is called for each dead block nothing
        holds any more (the store frees it there)."""
        blocks = list(blocks)
        self.hold(blocks)
        try:
            yield blocks
        finally:
            self.unhold(blocks, on_unheld)

    def hold(self, blocks: list[Block]) -> None:
        """``held`` without a context manager, for the hot path (a put holds its chain; the
        ``contextlib`` wrapper around a compiled generator cost ~1.2 us a put): the caller
        pairs it with :meth:`unhold` in a ``finally``."""
        for b in blocks:  # = busy(b), written out
            b.busy += 1

    def unhold(self, blocks: list[Block], on_unheld: Callable[[Block], None] | None = None) -> None:
        """End :meth:`hold` of ``blocks``; ``on_unheld`` as for :meth:`held`."""
        unheld = []  # every count first, then the frees
        for b in blocks:  # = unbusy(b), written out
            assert b.busy > 0, f"block {b.key.hex()[:12]}: busy count below zero"
            b.busy -= 1
            if b.dead and not b.busy and not b.leases:
                unheld.append(b)
        if on_unheld is not None:
            for b in unheld:
                on_unheld(b)

    def lease_resident(self, chain: list[Block], tier: TierName) -> list[int]:
        """Lease the blocks of ``chain`` from its start while they are live and in
        ``tier``; returns their slots in ``tier`` (as many as were leased: the caller leases
        the rest one by one, promoting each). One pass for the common case of a chain that
        is all resident, which also gives the lease its slots."""
        slots: list[int] = []
        append = slots.append
        name = TIER_KEY[tier]
        for b in chain:
            slot = b.loc.get(name)
            if slot is None or b.dead:
                break
            b.leases += 1
            append(slot)
        return slots

    def unlease_many(self, blocks: list[Block]) -> list[Block]:
        """Drop one lease of each block; returns those nothing holds any more that are dead
        or ephemeral (the only ones whose last release asks anything more of the caller). A
        block released more often than leased raises, with every count as it was before
        the call (the counts dropped before it are restored: one pass in the common case)."""
        unheld = []
        for i, b in enumerate(blocks):
            n = b.leases
            if n <= 0:
                for done in blocks[:i]:
                    done.leases += 1
                raise LeaseError(f"block {b.key.hex()[:12]} released more often than leased")
            b.leases = n - 1
            if n == 1 and not b.busy and (b.dead or b.priority == EPHEMERAL):
                unheld.append(b)
        return unheld
