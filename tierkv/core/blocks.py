"""The in-memory block table: which blocks exist, where each lives, and who holds it.

:class:`BlockTable` is the one owner of a block's locations: only :meth:`place` and
:meth:`unplace` change them (and keep the per-tier LRU lists in step). Leases and in-flight
I/O are counted on the block and changed only through the paired methods of the table's
``holds`` part, which check each transition (tierkv/core/holds.py: ``lease``/``unlease``,
``busy``/``unbusy``, and ``held`` for a scope); :meth:`victim` never returns a block that is leased, busy,
pinned, or that still has a child block in the same tier (leaf first: a block without its
prefix is useless, so prefixes outlive their extensions).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .holds import Holds
from .policy import DEFAULT_POLICY, HINT_FRESH, EvictionPolicy
from .policy_mix import make_policy
from .policy_spec import describe, tier_policies
from .priority import NORMAL, PINNED, Priority
from ..tiers.base import TIER_KEY, TierName

if TYPE_CHECKING:
    from ..tiers.base import SlotAllocator

TIERS = (TierName.DEVICE, TierName.HOST, TierName.DISK)
_TIER_NAMES = tuple(TIER_KEY[t] for t in TIERS)  # fastest first: the keys of Block.loc
PRIORITIES = tuple(Priority)  # iterating the enum itself costs more than a victim choice
_PRIORITY_NAME = {p: p.name.lower() for p in Priority}
_PINNED: Final = PINNED  # bound here once (tierkv/core/priority.py says why)
_NORMAL: Final = NORMAL
_DISK: Final = TierName.DISK


class Block:
    """A stored block's metadata: identity, token ids, checksum, locations and holds.

    A plain class with its own ``__init__`` rather than a dataclass: compiled
    (docs/architecture.md, "Compiled metadata path"), a dataclass keeps the ``__init__``
    that :mod:`dataclasses` generates as interpreted Python, ~1 us per block, and a put
    creates one per new block (5% of a replay at 1,000 blocks in ``perf``); this one
    compiles to a native constructor (0.1 us). Equality is identity, as before.

    ``loc`` and ``children`` hold only str, int and bytes (tier names as plain str, which
    equal and hash as the TierName members, and child keys as the keys of a dict): such
    dicts are not tracked by Python's cyclic garbage collector, so a block is one tracked
    object instead of three. A full collection walks every tracked object; with a
    200,000-block table it took 160-195 ms before this, and a daemon pauses for that long.
    """

    __slots__ = ("key", "parent", "model_version", "namespace", "tokens", "checksum", "priority", "loc",
                 "leases", "busy", "children", "dead", "top", "hint")

    def __init__(self, key: bytes, parent: bytes, model_version: str, namespace: str, tokens: bytes,
                 checksum: int, priority: Priority, loc: dict[str, int] | None = None, leases: int = 0,
                 busy: int = 0, children: dict[bytes, None] | None = None, dead: bool = False, top: str = "",
                 hint: int = HINT_FRESH) -> None:
        self.key = key
        self.parent = parent
        self.model_version = model_version
        self.namespace = namespace
        self.tokens = tokens
        self.checksum = checksum
        self.priority = priority
        self.loc: dict[str, int] = {} if loc is None else loc  # TierName value -> slot (BlockTable.place)
        self.leases = leases
        self.busy = busy  # in-flight reads of this block's pages (outside the store lock)
        self.children: dict[bytes, None] = {} if children is None else children  # child keys (a set, untracked)
        self.dead = dead  # invalidated or quarantined; freed when the last lease ends
        # The fastest tier holding the block ("" for none), kept by BlockTable.place/unplace so
        # that a lookup of thousands of blocks need not search each block's locations.
        self.top = top
        # Insertion class for the eviction policy (policy.HINT_*): set by put, read at place.
        self.hint = hint

    def __repr__(self) -> str:
        return (f"Block(key={self.key.hex()[:12]}, priority={self.priority.name}, loc={self.loc}, "
                f"leases={self.leases}, busy={self.busy}, dead={self.dead})")

    @property
    def tiers(self) -> list[TierName]:
        """The tiers holding the block, fastest first, as TierName members (``loc`` is keyed
        by their plain str names; the compiled table checks that a tier is a TierName)."""
        loc = self.loc
        return [t for t, name in zip(TIERS, _TIER_NAMES) if name in loc]

    @property
    def top_tier(self) -> TierName | None:
        """The fastest tier holding the block, from its locations (``top`` caches it)."""
        tiers = self.tiers
        return tiers[0] if tiers else None

    def _update_top(self) -> None:
        # Runs at every place/unplace; looked up by the plain str (tiers.base.TIER_KEY).
        loc = self.loc
        for name in _TIER_NAMES:
            if name in loc:
                self.top = name
                return
        self.top = ""


class BlockTable:
    """Blocks, their locations and victim choice; leases and busy counts through
    ``self.holds`` (:class:`tierkv.core.holds.Holds`, a part this table owns)."""

    def __init__(self, policy: str = DEFAULT_POLICY, capacities: dict[TierName, int] | None = None) -> None:
        """``policy`` names the eviction order of every tier, or of each
        (:mod:`tierkv.core.policy_spec`: ``"arc"``, ``"leader,disk=arc"``; the orders:
        :mod:`tierkv.core.policy`); ``capacities`` (slots per tier) bound the policies'
        ghost lists."""
        self.blocks: dict[bytes, Block] = {}
        # The paired lease and busy methods (the counts themselves are on each block).
        self.holds = Holds()
        # Children whose parent is not in the table, by parent key (a dict of keys, as
        # Block.children): an extension can be stored before its prefix (put with
        # start_block > 0) or outlive it in another tier; when the prefix arrives it must
        # learn its children, or leaf-first eviction could take it from under them.
        self._orphans: dict[bytes, dict[bytes, None]] = {}
        # One policy per tier and priority class: victims come from ephemeral first, then
        # normal, then pinned, each class in its policy's order.
        caps = capacities or {}
        policies = tier_policies(policy)
        self.policy = describe(policies)
        self._order: dict[TierName, dict[Priority, EvictionPolicy]] = {
            t: {p: make_policy(policies[t], caps.get(t, 0)) for p in Priority} for t in TIERS
        }
        # The same policies in victim order, per tier (victim() runs once per eviction).
        self._victim_order = {t: tuple(self._order[t][p] for p in PRIORITIES) for t in TIERS}
        # Evictions by tier and reason (the victim's priority class, or for normal blocks
        # the policy segment it came from: lru / cold / recent / frequent).
        self.evicted_by: dict[str, dict[str, int]] = {t.value: {} for t in TIERS}

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, key: bytes) -> Block | None:
        return self.blocks.get(key)

    def add(self, block: Block) -> None:
        assert block.key not in self.blocks
        self.add_new([block])

    def add_unlinked(self, block: Block) -> None:
        """Enter ``block`` without its parent link (opening: blocks come in key order, most
        before their parents, and :meth:`rebuild_children` links them all in one pass)."""
        assert block.key not in self.blocks and not block.loc
        self.blocks[block.key] = block

    def add_new(self, blocks: list[Block]) -> None:
        """Enter each block of ``blocks`` that is not in the table yet (a put's new blocks,
        in chain order, in one loop): linked to its parent, or an orphan until the parent
        comes; children that came before it are adopted."""
        table, orphans_of, link = self.blocks, self._orphans, self._link
        for b in blocks:
            key = b.key
            if key in table:
                continue
            assert not b.loc
            table[key] = b
            if orphans_of:
                orphans = orphans_of.pop(key, None)
                if orphans:
                    b.children.update(orphans)
            link(b)

    def _link(self, block: Block) -> None:
        parent = self.blocks.get(block.parent)
        if parent is not None:
            parent.children[block.key] = None
        else:
            self._orphans.setdefault(block.parent, {})[block.key] = None

    def _unlink(self, block: Block) -> None:
        """Forget ``block`` as a child; its own children become orphans."""
        parent = self.blocks.get(block.parent)
        if parent is not None:
            parent.children.pop(block.key, None)
        siblings = self._orphans.get(block.parent)
        if siblings is not None:
            siblings.pop(block.key, None)
            if not siblings:
                del self._orphans[block.parent]
        if block.children:  # most blocks that go are leaves: nothing to hand on
            live = [c for c in block.children if c in self.blocks]
            if live:
                self._orphans.setdefault(block.key, {}).update(dict.fromkeys(live))
            block.children = {}

    def rebuild_children(self) -> None:
        """Recompute every child set in one pass (after loading the index, where children
        may be read before their parents)."""
        self._orphans.clear()
        for b in self.blocks.values():
            b.children.clear()
        for b in self.blocks.values():
            self._link(b)

    def remove(self, block: Block) -> None:
        """Forget a block that no tier holds any more."""
        assert not block.loc, "remove() of a block that still has pages"
        if self.blocks.get(block.key) is block:
            del self.blocks[block.key]
            self._unlink(block)

    def detach(self, block: Block) -> None:
        """Make ``block`` unreachable (invalidated or quarantined) while its slots stay
        allocated until the store frees them: out of the table and every LRU list."""
        block.dead = True
        for t in block.tiers:
            self._order[t][block.priority].remove(block.key)
        if self.blocks.get(block.key) is block:
            del self.blocks[block.key]
            self._unlink(block)

    def place(self, block: Block, tier: TierName, slot: int) -> None:
        assert tier not in block.loc, f"block already in {tier.value}"
        block.loc[TIER_KEY[tier]] = slot  # the plain str (see Block)
        block._update_top()
        self._order[tier][block.priority].add(block.key, block.hint)

    def unplace(self, block: Block, tier: TierName, evicted: bool = False) -> int:
        """Take ``block`` out of ``tier``; ``evicted``: it was chosen as a victim (counted by
        reason, and the policy may keep a ghost of it)."""
        slot = block.loc.pop(TIER_KEY[tier])
        block._update_top()
        segment = self._order[tier][block.priority].remove(block.key, evicted)
        if evicted:
            reason = segment if block.priority == _NORMAL else _PRIORITY_NAME[block.priority]
            counts = self.evicted_by[TIER_KEY[tier]]
            counts[reason] = counts.get(reason, 0) + 1
        return slot

    def set_priority(self, block: Block, priority: Priority) -> None:
        for t in block.tiers:
            self._order[t][block.priority].remove(block.key)
            self._order[t][priority].add(block.key, block.hint)
        block.priority = priority

    def touch_chain(self, chain: list[Block], hit: bool = True) -> None:
        """Mark a prefix used (``hit``: a read found it; False: the re-ordering after a put).
        Leaf first, root last, so that in each recency list a prefix is always more recent
        than its extensions and eviction meets leaves first."""
        if not chain:
            return
        in_use = [o for orders in self._victim_order.values() for o in orders if o]
        keys = [b.key for b in reversed(chain)]
        # Each policy touches only the keys it holds and skips the others (a membership
        # test), so every list in use gets the whole chain: no grouping of the blocks by
        # tier and class, which cost a tuple and a dict update per block and tier (a daemon
        # hit on a 256-block prompt spent a fifth of its time there).
        for order in in_use:
            order.touch(keys, hit)

    def in_order(self, tier: TierName) -> list[bytes]:
        """The keys of ``tier`` in victim order, first victim first: ephemeral, then normal,
        then pinned blocks, each class in its policy's order (what a warm start records)."""
        return [k for order in self._victim_order[tier] for k in order.candidates()]

    def policy_stats(self) -> dict[str, object]:
        """The eviction policy's counters, per tier (merged into ``Store.stats()``)."""
        return {
            "eviction_policy": self.policy,
            "evicted_by": {t: dict(c) for t, c in self.evicted_by.items()},
            "ghost_hits": {t.value: sum(o.ghost_hits for o in self._order[t].values()) for t in TIERS},
            "cold_admissions": {t.value: sum(getattr(o, "cold_inserts", 0) for o in self._order[t].values())
                                for t in TIERS},
        }

    def evictable(self, block: Block, tier: TierName) -> bool:
        if block.leases or block.busy or block.priority == _PINNED and tier == _DISK:
            return False
        name = TIER_KEY[tier]
        for c in block.children:
            child = self.blocks.get(c)
            if child is not None and name in child.loc:
                return False
        return True

    def victim(self, tier: TierName) -> Block | None:
        """The policy's first evictable block of ``tier``: ephemeral, then normal, then (in
        memory tiers only) pinned, which stays on disk."""
        blocks, evictable = self.blocks, self.evictable
        for order in self._victim_order[tier]:
            if not order:  # most classes are empty most of the time
                continue
            b = blocks[order.head()]  # the policy's first choice, without a generator
            if not b.children and not b.leases and not b.busy and b.priority != _PINNED:
                return b
            for key in order.candidates():
                b = blocks[key]
                # The common case first, without the call: an unheld leaf (for pinned
                # blocks in the disk tier, evictable() says no).
                if not b.children and not b.leases and not b.busy and b.priority != _PINNED:
                    return b
                if evictable(b, tier):
                    return b
        return None

    def place_dropping(self, blocks: list[Block], tier: TierName, slots: "SlotAllocator") -> tuple[list[int], int]:
        """Place ``blocks`` in ``tier`` in order, each in a slot of ``slots`` (the tier's
        allocator), making room by dropping victims (:meth:`victim`, :meth:`drop`): the
        caller has checked that an eviction from ``tier`` only drops (no lower tier, no
        listener). Stops at the first block for which nothing can be evicted; returns the
        slots of those placed (the first ``len`` blocks) and the number of evictions.

        One loop for a put into a full tier (scripts/replay_trace.py, issue #12): ``place``
        written out, and a victim's slot handed straight to the new block."""
        alloc, reuse = slots.alloc, slots.reuse
        orders = self._order[tier]
        victim, drop = self.victim, self.drop
        key = TIER_KEY[tier]
        placed: list[int] = []
        evicted = 0
        for b in blocks:
            slot = alloc()
            while slot is None:
                v = victim(tier)
                if v is None:
                    return placed, evicted
                evicted += 1
                slot = reuse(drop(v, tier))
            b.loc[key] = slot  # = place(b, tier, slot)
            b._update_top()
            orders[b.priority].add(b.key, b.hint)
            placed.append(slot)
        return placed, evicted

    def drop_victim(self, tier: TierName) -> int | None:
        """Evict the victim of ``tier`` by dropping it there (the caller has checked that
        nothing else follows an eviction: no lower tier, no listener); returns its freed
        slot, or None when nothing can be evicted."""
        b = self.victim(tier)
        return None if b is None else self.drop(b, tier)

    def drop(self, b: Block, tier: TierName) -> int:
        """Evict ``b`` from ``tier`` by dropping it (``unplace`` as a victim, and out of the
        table when no tier holds it any more); returns its slot there."""
        slot = self.unplace(b, tier, True)
        if not b.loc:
            self.remove(b)
        return slot

    def check_integrity(self) -> None:
        for t in TIERS:
            listed = {k for d in self._order[t].values() for k in d.keys()}
            placed = {k for k, b in self.blocks.items() if t in b.loc}
            assert listed == placed, f"{t.value}: eviction lists and locations disagree"
            for prio, d in self._order[t].items():
                d.check_integrity()
                assert all(self.blocks[k].priority == prio for k in d.keys()), "block listed under the wrong priority"
        for k, b in self.blocks.items():
            assert b.key == k and b.leases >= 0 and b.busy >= 0
            assert b.top == (b.top_tier.value if b.top_tier is not None else ""), "cached top tier is stale"
            assert b.loc, f"block {k.hex()[:12]} has no pages in any tier"
            assert not b.dead, f"block {k.hex()[:12]} is dead but still in the table"
            assert b.children.keys() <= self.blocks.keys(), "child set names a block not in the table"
            assert all(type(t) is str for t in b.loc), "a location keyed by a TierName member (see Block)"
            for c in b.children:
                assert self.blocks[c].parent == k, "child set names a block of another parent"
            parent = self.blocks.get(b.parent)
            links = parent.children if parent is not None else self._orphans.get(b.parent, {})
            assert k in links, f"block {k.hex()[:12]} missing from its parent's children"
        for pk, kids in self._orphans.items():
            assert pk not in self.blocks and kids and kids.keys() <= self.blocks.keys(), "stale orphan entry"
