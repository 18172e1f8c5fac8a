"""Every StoreAPI method, the same scenario against the embedded store, a daemon client and
a cluster node: same results, same result types, same errors."""
from __future__ import annotations

import json
from concurrent.futures import Future

import numpy as np
import pytest
import torch

import tierkv
from tierkv import Priority, Scope
from tierkv.api import StoreAPI
from tierkv.errors import DaemonUnavailableError, LeaseError, NotFoundError, TierKVError
from tierkv.identity import block_keys
from tierkv.results import (
    ChainTokens, InvalidateResult, Lease, LookupResult, PutResult, Residency, StoreStats, TierStats, VerifyResult,
)

from .kit import BS, KINDS, LAYOUT, MV_A, MV_B, SCOPE, open_impl, pages_for, remove, short_dir, tokens

LOCAL_TIERS = {"device", "host", "disk"}


def put_all(api, toks: np.ndarray, scope: Scope = SCOPE, **kw) -> PutResult:
    return api.put(toks, pages_for(toks, scope), scope, **kw)


def test_declares_and_keeps_the_protocol(api):
    assert isinstance(api, StoreAPI)
    assert api.layout == LAYOUT
    for name in [n for n in dir(StoreAPI) if not n.startswith("_")] + ["__enter__", "__exit__"]:
        if name == "layout":
            continue
        impl_fn = getattr(type(api), name)
        assert impl_fn is not getattr(StoreAPI, name) or name in ("__enter__", "__exit__"), \
            f"{type(api).__name__} inherits the protocol's stub of {name}"


def test_put_is_durable_and_idempotent(api):
    t = tokens(1, 5, extra=3)
    r = put_all(api, t)
    assert r == PutResult(stored=5, skipped=0, durable=True)
    assert put_all(api, t) == PutResult(stored=0, skipped=5, durable=True)
    more = tokens(1, 5)[: 3 * BS]  # a prefix of the same chain: all skipped
    assert api.put(more, pages_for(more), SCOPE) == PutResult(0, 3, True)


def test_put_in_windows_and_bad_pages(api):
    t = tokens(2, 6)
    pages = pages_for(t)
    assert api.put(t[: 2 * BS], pages[:2], SCOPE).stored == 2
    assert api.put(t, pages[2:], SCOPE, start_block=2).stored == 4
    assert api.lookup(t, SCOPE).tokens_matched == 6 * BS
    with pytest.raises(TierKVError):
        api.put(t, pages[:1].to(torch.float64), SCOPE)  # wrong dtype
    with pytest.raises(TierKVError):
        api.put(t[:BS], pages[:3], SCOPE)  # more pages than full blocks


def test_lookup_matches_keys_and_scope(api):
    t = tokens(3, 4, extra=2)
    put_all(api, t)
    r = api.lookup(t, SCOPE)
    assert isinstance(r, LookupResult)
    assert r.tokens_matched == 4 * BS and r.num_blocks == 4
    assert list(r.keys) == api.block_keys(t, SCOPE)  # the store's keys (a tenant's are its own)
    assert len(r.tiers) == 4 and set(r.tiers) <= LOCAL_TIERS
    other = tokens(3, 4).copy()
    other[2 * BS + 1] += 1  # differs in block 2
    assert api.lookup(other, SCOPE).tokens_matched == 2 * BS
    assert api.lookup(t, Scope(MV_B, SCOPE.namespace)).tokens_matched == 0
    assert api.lookup(t, Scope(MV_A, "tenant-b")).tokens_matched == 0
    assert api.lookup(t[: BS - 1], SCOPE) == LookupResult(0, (), ())


def test_acquire_release_and_windows(api):
    t = tokens(4, 6)
    pages = pages_for(t)
    put_all(api, t)
    with api.acquire(t, SCOPE) as lease:
        assert isinstance(lease, Lease)
        assert lease.num_blocks == 6 and lease.tokens_matched == 6 * BS
        assert torch.equal(lease.pages().cpu(), pages)
        assert torch.equal(lease.page(5).cpu(), pages[5])
        assert api.stats().leased_blocks == 6
    assert api.stats().leased_blocks == 0
    with pytest.raises(LeaseError):
        lease.page(0)  # used after release
    with pytest.raises(LeaseError):
        api.release(lease)  # released twice
    win = api.acquire(t, SCOPE, max_blocks=2, start_block=3)
    try:
        assert win.num_blocks == 2 and win.start_block == 3 and win.tokens_matched == 5 * BS
        assert torch.equal(win.pages().cpu(), pages[3:5])
    finally:
        api.release(win)
    with pytest.raises(ValueError):
        api.acquire(t, SCOPE, start_block=-1)
    empty = api.acquire(tokens(99, 2), SCOPE)
    assert empty.num_blocks == 0 and empty.tokens_matched == 0
    empty.release()


def test_prefetch_warms_without_holding(api):
    t = tokens(5, 3)
    put_all(api, t)
    fut = api.prefetch(t, SCOPE)
    assert isinstance(fut, Future)
    assert fut.result(timeout=30) == 3 * BS
    assert api.prefetch(tokens(98, 2), SCOPE).result(timeout=30) == 0
    assert api.stats().leased_blocks == 0


def test_priority_by_tokens_and_by_last_key(api):
    t = tokens(6, 4)
    put_all(api, t)
    last = api.block_keys(t, SCOPE)[-1]
    assert api.set_priority(t, SCOPE, Priority.PINNED) == 4
    res = api.chain_residency(last)
    assert res.blocks == 4 and res.disk == 4
    assert api.set_priority_from(last, Priority.NORMAL) == 4
    assert api.set_priority_from(api.block_keys(t, SCOPE)[1], Priority.PINNED) == 2
    assert api.set_priority_from(b"\x00" * 32, Priority.PINNED) == 0
    assert api.set_priority(tokens(97, 2), SCOPE, Priority.PINNED) == 0


def test_chain_tokens_and_residency(api):
    t = tokens(7, 5, extra=1)
    put_all(api, t)
    keys = api.block_keys(t, SCOPE)
    ct = api.chain_tokens(keys[-1])
    assert isinstance(ct, ChainTokens)
    assert np.array_equal(ct.tokens, t[: 5 * BS]) and ct.tokens.dtype == np.int32
    assert (ct.model_version, ct.namespace) == (SCOPE.model_version, SCOPE.namespace)
    toks_, mv, ns = api.chain_tokens(keys[1])  # unpacks like the tuple it replaced
    assert np.array_equal(toks_, t[: 2 * BS]) and mv == MV_A and ns == SCOPE.namespace
    with pytest.raises(NotFoundError):
        api.chain_tokens(b"\x01" * 32)
    res = api.chain_residency(keys[-1])
    assert isinstance(res, Residency)
    assert res.blocks == 5 and res.disk == 5 and res.device + res.host >= 1
    assert api.chain_residency(keys[2]).blocks == 3
    assert api.chain_residency(b"\x01" * 32) == Residency()
    # The keys the store keeps the chain under (here, with no namespace rewriting: the
    # scope's own), whole or the first n.
    assert api.block_keys(t, SCOPE) == keys and api.block_keys(t, SCOPE, 2) == keys[:2]


def test_manifests(api):
    manifest = {"kind": "prefix", "tokens": 8, "blocks": 2, "nested": {"a": [1, 2]}, "pinned": False}
    api.save_manifest("docs", manifest)
    assert api.get_manifest("docs") == manifest
    got = api.get_manifest("docs")
    got["pinned"] = True  # a copy: changing it changes nothing stored
    assert api.get_manifest("docs")["pinned"] is False
    api.save_manifest("other", {"kind": "prefix"})
    assert api.list_manifests() == {"docs": manifest, "other": {"kind": "prefix"}}
    with pytest.raises(NotFoundError, match="docs"):
        api.get_manifest("nope")
    for bad in ("", "a/b", "x" * 201):
        with pytest.raises(ValueError):
            api.save_manifest(bad, {})
    assert api.delete_manifest("docs") is True
    assert api.delete_manifest("docs") is False
    assert list(api.list_manifests()) == ["other"]


def test_invalidate(api):
    a, b = tokens(8, 3), tokens(9, 2)
    put_all(api, a)
    put_all(api, b, Scope(MV_B))
    dry = api.invalidate(model_version=MV_B, dry_run=True)
    assert isinstance(dry, InvalidateResult)
    assert dry.removed_blocks == 2 and dry.freed_bytes > 0 and dry.dry_run
    assert api.lookup(b, Scope(MV_B)).tokens_matched == 2 * BS
    r = api.invalidate(model_version=MV_B)
    assert (r.removed_blocks, r.freed_bytes, r.dry_run) == (2, dry.freed_bytes, False)
    assert api.lookup(b, Scope(MV_B)).tokens_matched == 0
    assert api.invalidate(model_version=MV_B).removed_blocks == 0  # idempotent
    assert api.invalidate(namespace=SCOPE.namespace).removed_blocks == 3
    assert api.lookup(a, SCOPE).tokens_matched == 0
    with pytest.raises(ValueError):
        api.invalidate()


def test_invalidate_while_leased(api):
    t = tokens(10, 3)
    pages = pages_for(t)
    put_all(api, t)
    with api.acquire(t, SCOPE) as lease:
        assert api.invalidate(model_version=MV_A).removed_blocks == 3
        assert api.lookup(t, SCOPE).tokens_matched == 0
        assert torch.equal(lease.pages().cpu(), pages)  # the lease still reads its pages
    assert api.stats().blocks == 0


def test_verify(api):
    put_all(api, tokens(11, 3))
    r = api.verify()
    assert r == VerifyResult(checked=3, corrupt=(), repaired=False, unreadable=())
    assert api.verify(repair=True) == VerifyResult(3, (), True)


def test_stats_are_typed_and_json_stable(api):
    put_all(api, tokens(12, 3))
    put_all(api, tokens(13, 2), Scope(MV_B, "other"))
    api.lookup(tokens(12, 3), SCOPE)
    s = api.stats()
    assert isinstance(s, StoreStats)
    assert s.blocks == 5 and s.leased_blocks == 0
    from tierkv.home.tenant import TenantView

    # A tenant sees no per-model-version counts: they would tell which models others serve.
    assert dict(s.model_versions) == ({} if isinstance(api, TenantView) else {MV_A: 3, MV_B: 2})
    assert dict(s.namespaces) == {SCOPE.namespace: 3, "other": 2}
    assert LOCAL_TIERS <= set(s.tiers) and all(isinstance(t, TierStats) for t in s.tiers.values())
    assert s.tiers["disk"].blocks == 5 and s.tiers["disk"].used_bytes == 5 * LAYOUT.page_bytes
    assert s.tiers["device"].capacity_bytes > 0
    assert s.counters.lookups >= 1 and s.counters.hits["device"] + s.counters.hits["host"] >= 3
    assert s.layout == LAYOUT.to_dict()
    d = s.as_dict()
    assert json.loads(s.to_json()) == json.loads(json.dumps(d))
    # The JSON shape tests, docs/cli.md and the metrics rely on.
    assert {"home", "layout", "blocks", "leased_blocks", "tiers", "model_versions", "namespaces", "lookups",
            "hits", "hit_rate", "hit_rate_by_tier", "evictions", "promoted_bytes", "quarantined"} <= set(d)
    assert d["tiers"]["disk"]["blocks"] == 5 and s["tiers"]["disk"]["blocks"] == 5
    assert StoreStats.from_dict(d).as_dict() == d
    with pytest.raises(TypeError):
        s["blocks"] = 0  # read-only: build a new one with dataclasses.replace
    # Paged namespaces: sorted by name, a cursor while more remain, totals over everything.
    assert s.namespaces_next is None and "namespaces_next" not in d
    first = api.stats(namespace_limit=1)
    assert list(first.namespaces) == [min(s.namespaces)] and first.namespaces_next == min(s.namespaces)
    assert first.blocks == 5 and dict(first.model_versions) == dict(s.model_versions)
    rest = api.stats(namespace_limit=1, namespace_after=first.namespaces_next)
    assert list(rest.namespaces) == [max(s.namespaces)] and rest.namespaces_next is None
    assert StoreStats.from_dict(first.as_dict()).namespaces_next == first.namespaces_next
    with pytest.raises(ValueError):
        api.stats(namespace_limit=0)


def test_integrity_after_a_busy_scenario(api):
    for i in range(40):  # 40 chains of 3: evicts from device and host
        t = tokens(100 + i, 3)
        put_all(api, t)
        if i % 3 == 0:
            with api.acquire(t, SCOPE) as lease:
                assert lease.num_blocks == 3
    api.check_integrity()
    s = api.stats()
    assert s.blocks == 120 and s.counters.evictions["device"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_close_is_idempotent_and_final(kind):
    from .kit import open_impl as _open

    workdir = short_dir(f"tkvconf-{kind[:3]}-")
    impl = _open(kind, workdir)
    try:
        with impl.api as api:
            put_all(api, tokens(14, 2))
        impl.api.close()  # a second close does nothing
        with pytest.raises((NotFoundError, DaemonUnavailableError)):
            impl.api.lookup(tokens(14, 2), SCOPE)
    finally:
        for fn in reversed(impl.cleanup):
            fn()
        remove(workdir)


@pytest.mark.parametrize("kind", KINDS)
def test_reopen_keeps_what_was_put(kind):
    workdir = short_dir(f"tkvconf-{kind[:3]}-")
    t = tokens(15, 4)
    try:
        impl = open_impl(kind, workdir)
        put_all(impl.api, t)
        impl.api.save_manifest("kept", {"last_block_key": block_keys(t, SCOPE, BS)[-1].hex()})
        impl.close()
        impl = open_impl(kind, workdir)
        try:
            assert impl.api.lookup(t, SCOPE).tokens_matched == 4 * BS
            with impl.api.acquire(t, SCOPE) as lease:
                assert torch.equal(lease.pages().cpu(), pages_for(t))
            assert "kept" in impl.api.list_manifests()
            impl.api.check_integrity()
        finally:
            impl.close()
    finally:
        remove(workdir)


def test_connect_is_typed():
    import inspect

    from tierkv.daemon.client import Client

    ret = inspect.signature(tierkv.connect).return_annotation
    assert ret in (Client, "Client"), f"tierkv.connect() is annotated {ret!r}, not the client"
    # Declared, not only structurally alike (issubclass is refused for protocols with data members).
    from tierkv.cluster import ClusterNode
    from tierkv.store import Store

    for cls in (Store, Client, ClusterNode):
        assert StoreAPI in cls.__mro__, f"{cls.__name__} does not declare StoreAPI"


def test_block_extra_keys_the_chain(api):
    t = tokens(16, 3)
    extra = [["img:a"], ["img:b"], []]
    keys = api.block_keys(t, SCOPE, None, extra)
    assert keys != api.block_keys(t, SCOPE)
    pages = torch.stack([pages_for(t)[i] for i in range(3)])
    assert api.put(t, pages, SCOPE, block_extra=extra).stored == 3
    assert api.lookup(t, SCOPE).tokens_matched == 0  # other keys without the extra
    r = api.lookup(t, SCOPE, extra)
    assert r.tokens_matched == 3 * BS and list(r.keys) == keys
    with api.acquire(t, SCOPE, extra) as lease:
        assert torch.equal(lease.pages().cpu(), pages)
    assert api.prefetch(t, SCOPE, extra).result(timeout=30) == 3 * BS


def test_ephemeral_blocks_stay_in_memory_and_go_with_their_lease(api):
    t = tokens(17, 2)
    r = put_all(api, t, priority=Priority.EPHEMERAL)
    assert (r.stored, r.durable) == (2, False)
    assert api.lookup(t, SCOPE).tokens_matched == 2 * BS
    assert api.stats().tiers["disk"].blocks == 0
    with api.acquire(t, SCOPE) as lease:
        assert torch.equal(lease.pages().cpu(), pages_for(t))
    assert api.lookup(t, SCOPE).tokens_matched == 0  # dropped when the lease ended


@pytest.mark.parametrize("kind", KINDS)
def test_check_integrity_sees_a_damaged_store(kind):
    """Through a daemon too: the client asks the daemon to check its stores."""
    workdir = short_dir(f"tkvconf-{kind[:3]}-")
    impl = open_impl(kind, workdir)
    try:
        put_all(impl.api, tokens(18, 2))
        impl.api.check_integrity()
        local = impl.local
        with local.placement.lock:  # damage: a device slot freed behind the block table's back
            block = next(b for b in local.placement.table.blocks.values() if "device" in b.loc)
            slot = block.loc["device"]
            local.device.slots.free(slot)
        with pytest.raises(AssertionError, match="device"):
            impl.api.check_integrity()
        with local.placement.lock:
            assert local.device.slots.alloc() == slot  # repaired, so that closing is clean
    finally:
        impl.close()
        remove(workdir)
