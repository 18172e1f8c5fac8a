"""The eviction-listener seam (tierkv/core/eviction.py): told exactly when a block's last local
copy goes, with its page bytes and recorded checksum; filtered; never fails an eviction."""
from __future__ import annotations

import torch

from tierkv import Priority, Scope
from tierkv.checksum import page_checksum
from tierkv.core.eviction import EvictedBlock

from .kit import MV2, SCOPE, SLOT, keys_of, page_for, put_chain, toks


def test_listener_gets_each_block_leaving_its_last_tier_with_its_page(make_store):
    store = make_store(disk_bytes=8 * SLOT, segment_pages=4)
    seen: list[EvictedBlock] = []
    store.add_eviction_listener(seen.append)
    chains = [toks(500 + i, 2) for i in range(8)]  # 16 blocks through 8 disk slots
    for t in chains:
        put_chain(store, t)
    assert seen, "disk evictions happened, so the listener must have been told"
    stored = {k for t in chains for k in keys_of(t) if store.lookup(t, SCOPE).keys.count(k)}
    for ev in seen:
        assert ev.tier == "disk" and ev.key not in stored  # really gone from every tier
        assert torch.equal(ev.page, page_for(ev.key)) and ev.page.device.type == "cpu"
        assert ev.checksum == page_checksum(ev.key, ev.page)
        assert ev.model_version == SCOPE.model_version and ev.priority == Priority.NORMAL
    assert len({ev.key for ev in seen}) == len(seen)


def test_eviction_from_memory_with_a_disk_copy_is_not_a_last_copy(make_store):
    store = make_store()  # device 4 pages, host 4 slots, disk 32 slots: no disk eviction
    seen: list[EvictedBlock] = []
    store.add_eviction_listener(seen.append)
    for i in range(6):
        put_chain(store, toks(600 + i, 2))
    assert store.stats().counters.evictions["device"] > 0 and not seen


def test_wants_filters_before_the_page_is_read_and_a_failing_listener_is_skipped(make_store):
    store = make_store(disk_bytes=8 * SLOT, segment_pages=4)
    other = Scope(MV2, "other")
    seen: list[EvictedBlock] = []
    asked: list[str] = []

    def broken(ev: EvictedBlock) -> None:
        raise RuntimeError("listener bug")

    store.add_eviction_listener(broken)
    store.add_eviction_listener(seen.append, lambda ns, prio: asked.append(ns) or ns == "other")
    for i in range(8):
        put_chain(store, toks(700 + i, 2), other if i % 2 else SCOPE)
    assert asked and seen and all(ev.namespace == "other" for ev in seen)
    store.remove_eviction_listener(seen.append)
    store.remove_eviction_listener(broken)
    assert not store.placement.eviction_listeners
