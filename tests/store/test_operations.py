"""Operations: invalidate, verify, manifests, pinning by manifest, prefetch, residency, stats."""
from __future__ import annotations

import pytest

from tierkv import Priority, Scope
from tierkv.errors import InvalidNameError, NotFoundError
from tierkv.results import Residency

from .kit import (BS, MV1, MV2, PAGE, SCOPE, SLOT, assert_lease_exact, keys_of, put_chain, segment_files,
                  tier_counts, tier_keys, toks)


def test_invalidate_model_version_everywhere(make_store, home):
    store = make_store()
    v1 = [toks(900 + i, 3) for i in range(3)]  # 9 blocks: spread over device, host, disk
    v2 = Scope(MV2)
    for c in v1:
        put_chain(store, c)
    put_chain(store, v1[0], v2)  # the same prompt under the new weights
    assert len(segment_files(home)) == 4
    dry = store.invalidate(model_version=MV1, dry_run=True)
    assert dry.dry_run and dry.removed_blocks == 9
    assert store.lookup(v1[0], SCOPE).num_blocks == 3  # a dry run changes nothing
    r = store.invalidate(model_version=MV1)
    assert r.removed_blocks == 9 and not r.dry_run
    assert r.freed_bytes == dry.freed_bytes >= 9 * SLOT
    for c in v1:
        assert store.lookup(c, SCOPE).num_blocks == 0
        with store.acquire(c, SCOPE) as lease:
            assert lease.num_blocks == 0
    assert store.lookup(v1[0], v2).num_blocks == 3
    assert store.stats()["model_versions"] == {MV2: 3}
    assert len(segment_files(home)) == 1  # v1's segments deleted: disk space given back
    assert store.invalidate(model_version=MV1).removed_blocks == 0  # idempotent
    store.close()
    store = make_store()
    assert store.lookup(v1[1], SCOPE).num_blocks == 0  # durable
    assert store.lookup(v1[0], v2).num_blocks == 3


def test_invalidate_namespace_and_both(make_store):
    store = make_store()
    a, b = Scope(MV1, namespace="a"), Scope(MV1, namespace="b")
    chain = toks(910, 2)
    put_chain(store, chain, a)
    put_chain(store, chain, b)
    put_chain(store, chain, Scope(MV2, namespace="a"))
    assert store.invalidate(namespace="a", model_version=MV1).removed_blocks == 2
    assert store.lookup(chain, Scope(MV2, namespace="a")).num_blocks == 2
    assert store.invalidate(namespace="a").removed_blocks == 2
    assert store.lookup(chain, b).num_blocks == 2
    assert store.stats()["namespaces"] == {"b": 2}
    with pytest.raises(ValueError):
        store.invalidate()


def test_invalidate_leased_blocks(make_store, home):
    store = make_store()
    chain = toks(920, 3)
    put_chain(store, chain)
    lease = store.acquire(chain, SCOPE)
    r = store.invalidate(namespace="default")
    assert r.removed_blocks == 3
    # Unreachable at once, from every tier and after a restart ...
    assert store.lookup(chain, SCOPE).num_blocks == 0
    assert store.index.count_blocks() == 0
    # ... but the leaseholder's pages stay intact and allocated until release.
    assert_lease_exact(lease)
    assert store.stats()["tiers"]["device"]["blocks"] == 3
    assert store.stats()["tiers"]["disk"]["blocks"] == 3
    store.check_integrity()
    put_chain(store, chain)  # the same prompt stored again gets new slots
    assert_lease_exact(lease)
    with store.acquire(chain, SCOPE) as fresh:
        assert set(fresh.slots).isdisjoint(lease.slots)
        assert_lease_exact(fresh)
    lease.release()
    assert store.stats()["tiers"]["disk"]["blocks"] == 3  # only the new copies
    store.invalidate(namespace="default")
    assert tier_counts(store) == {"device": 0, "host": 0, "disk": 0}
    assert segment_files(home) == []


def test_verify_clean_store(make_store):
    store = make_store()
    for i in range(3):
        put_chain(store, toks(930 + i, 2))
    r = store.verify(repair=True)
    assert r.checked == 6 and r.corrupt == () and r.repaired
    assert store.stats()["quarantined"] == 0


def test_manifests(make_store):
    store = make_store()
    chain = toks(940, 3)
    put_chain(store, chain)
    last = keys_of(chain)[-1]
    store.save_manifest("system-prompt", {"last_key": last.hex(), "tokens": len(chain)})
    assert store.get_manifest("system-prompt")["tokens"] == len(chain)
    assert list(store.list_manifests()) == ["system-prompt"]
    # The daemon's rule in the embedded store too (issue #32: a lone surrogate or 400+ bytes
    # of UTF-8 reached LMDB as a raw UnicodeEncodeError / BadValsizeError).
    for bad in ("", "a/b", "x" * 201, "\ud800x", "\u00e9" * 199 + "\U0001f600" * 1):
        with pytest.raises(InvalidNameError):
            store.save_manifest(bad, {})
    assert list(store.list_manifests()) == ["system-prompt"]
    with pytest.raises(NotFoundError) as info:
        store.get_manifest("nope")
    assert "system-prompt" in str(info.value)
    # Pin the chain a manifest names; it survives disk pressure.
    assert store.set_priority_from(last, Priority.PINNED) == 3
    assert store.chain_residency(last) == Residency(blocks=3, device=3, host=0, disk=3)
    store.close()
    store = make_store(disk_bytes=8 * SLOT, segment_pages=4)
    for i in range(6):
        put_chain(store, toks(941 + i, 2))
    assert store.chain_residency(last).disk == 3
    assert store.get_manifest("system-prompt")["tokens"] == len(chain)  # durable
    assert store.delete_manifest("system-prompt") and not store.delete_manifest("system-prompt")
    assert store.list_manifests() == {}


def test_pinning_flushes_memory_only_blocks(make_store, home):
    store = make_store(write_through=False)
    chain = toks(950, 2)
    put_chain(store, chain)
    assert tier_counts(store)["disk"] == 0
    assert store.set_priority(chain, SCOPE, Priority.PINNED) == 2
    assert tier_counts(store)["disk"] == 2
    store.close()
    store = make_store()
    assert store.lookup(chain, SCOPE).num_blocks == 2


def test_prefetch_warms_the_device(make_store):
    store = make_store()
    chain = toks(960, 3)
    put_chain(store, chain)
    for i in range(3):
        put_chain(store, toks(961 + i, 4))
    assert store.lookup(chain, SCOPE).tiers == ("disk",) * 3
    assert store.prefetch(chain, SCOPE).result(timeout=30) == 3 * BS
    assert store.lookup(chain, SCOPE).tiers == ("device",) * 3
    assert store.stats()["leased_blocks"] == 0
    assert store.prefetch(toks(999, 2), SCOPE).result(timeout=30) == 0


def test_stats_counters(make_store):
    store = make_store()
    chain = toks(970, 2)
    put_chain(store, chain)
    store.lookup(chain, SCOPE)
    store.lookup(toks(971, 2), SCOPE)
    with store.acquire(chain, SCOPE):
        pass
    st = store.stats()
    assert st["lookups"] == 2 and st["lookup_blocks"] == 4 and st["hit_rate"] == 0.5
    assert st["hits"]["device"] == 2 and st["acquires"] == 1 and st["puts"] == 1
    assert st["blocks"] == 2 and st["layout"]["block_size"] == BS
    assert st["tiers"]["device"]["capacity_bytes"] == 4 * PAGE
    assert MV1 in st["model_versions"]
    assert st["acquire_blocks"] == 2 and st["acquire_hit_rate"] == 1.0


def test_acquire_hit_rate_counts_each_acquires_window(make_store):
    """Blocks leased over the full blocks each acquire asked for (its window's), by the tier
    each came from: the hit rate of a client that acquires without looking up first (a
    daemon's acquire is one request), for whom the lookup hit rate stays 0."""
    store = make_store()  # device 4, host 4, disk 32 pages
    chain = toks(980, 3)
    put_chain(store, chain[: 2 * BS])  # blocks 0-1 of the 3
    with store.acquire(chain, SCOPE) as lease:  # asks 3, finds 2, both in the device tier
        assert lease.num_blocks == 2
    with store.acquire(chain, SCOPE, start_block=1, max_blocks=1):  # its window: 1 block, found
        pass
    with store.acquire(toks(981, 2, extra=BS - 1), SCOPE):  # 2 full blocks asked (never the partial one), none found
        pass
    lease = store.acquire_resident(chain[: 2 * BS], SCOPE)  # the daemon's path: asks 2, finds 2
    assert lease is not None and lease.num_blocks == 2
    store.release(lease)
    st = store.stats()
    assert st["lookups"] == 0 and st["hit_rate"] == 0.0
    assert st["acquires"] == 4 and st["acquire_blocks"] == 3 + 1 + 2 + 2
    assert st["acquire_hits"] == {"device": 5, "host": 0, "disk": 0}
    assert st["acquire_hit_rate"] == pytest.approx(5 / 8)
    assert st["acquire_hit_rate_by_tier"] == pytest.approx({"device": 5 / 8, "host": 0.0, "disk": 0.0})
    fresh = toks(982, 2)
    put_chain(store, fresh)
    for i in range(6):  # 12 other blocks: ``fresh``, never read, leaves the device tier (disk keeps it)
        put_chain(store, toks(990 + i, 2))
    assert not set(keys_of(fresh)) & tier_keys(store)["device"]
    with store.acquire(fresh, SCOPE) as lease:  # read back from below the device tier
        assert lease.num_blocks == 2
    st = store.stats()
    assert st["acquire_blocks"] == 8 + 2 and st["acquire_hits"]["host"] + st["acquire_hits"]["disk"] == 2
    assert st["acquire_hit_rate"] == pytest.approx(7 / 10)
