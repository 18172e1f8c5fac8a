"""Property-based: random sequences of put / lookup / acquire / release / invalidate / pin /
verify / reopen checked against a model (the set of stored block keys), with
check_integrity() after every step."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv import Priority, Scope

from .kit import BS, MV1, MV2, SCOPE, assert_lease_exact, keys_of, open_store, pages_for, toks

BASE = toks(600, 4)
CHAINS: list[tuple[list[int], Scope]] = [
    (BASE, SCOPE),
    (BASE[: 2 * BS] + toks(601, 2), SCOPE),  # shares two blocks with BASE
    (toks(602, 3), SCOPE),
    (BASE, Scope(MV1, namespace="other")),  # same tokens, other tenant
    (toks(603, 4), Scope(MV2)),
]
EPHEMERAL_CHAIN = (toks(604, 2), SCOPE)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierkv-prop-"))
        # Device 8 pages (a whole chain fits with room to spare), host 3, disk big enough
        # that nothing acknowledged is evicted from it.
        self.opts = dict(shm_dir=self.dir / "shm", device_bytes=8 * 1024, host_bytes=3 * 4096,
                         disk_bytes=64 * 4096, segment_pages=4)
        self.store = open_store(self.dir / "home", **self.opts)
        self.present: set[bytes] = set()
        self.leases: list = []

    def teardown(self) -> None:
        try:
            for lease in self.leases:
                lease.release()
            self.store.check_integrity()
            self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def expected(self, c: int) -> int:
        n = 0
        for k in keys_of(*CHAINS[c]):
            if k not in self.present:
                break
            n += 1
        return n

    @rule(c=st.integers(0, len(CHAINS) - 1), data=st.data(), pinned=st.booleans())
    def put(self, c, data, pinned):
        tokens, scope = CHAINS[c]
        n_full = len(tokens) // BS
        n = data.draw(st.integers(1, n_full))
        start = data.draw(st.integers(0, n - 1))
        pages = pages_for(tokens[: n * BS], scope)[start:n]
        r = self.store.put(tokens[: n * BS], pages, scope, start_block=start,
                           priority=Priority.PINNED if pinned else Priority.NORMAL)
        keys = keys_of(tokens[: n * BS], scope)[start:n]
        assert r.stored + r.skipped == n - start
        assert r.stored == sum(k not in self.present for k in keys)
        assert r.durable
        self.present.update(keys)

    @rule(c=st.integers(0, len(CHAINS) - 1), extra=st.integers(0, BS - 1))
    def lookup(self, c, extra):
        tokens, scope = CHAINS[c]
        r = self.store.lookup(tokens + [7] * extra, scope)
        assert r.num_blocks == self.expected(c)
        assert r.keys == tuple(keys_of(tokens, scope)[: r.num_blocks])
        assert r.tokens_matched == r.num_blocks * BS

    @precondition(lambda self: len(self.leases) < 3)
    @rule(c=st.integers(0, len(CHAINS) - 1))
    def acquire(self, c):
        tokens, scope = CHAINS[c]
        held = bool(self.leases)
        lease = self.store.acquire(tokens, scope)
        assert_lease_exact(lease)
        if held:
            assert lease.num_blocks <= self.expected(c)
        else:
            assert lease.num_blocks == self.expected(c)
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        assert_lease_exact(lease)  # still intact, whatever happened meanwhile
        lease.release()

    @rule(which=st.sampled_from(["namespace", "model_version", "dry_run"]))
    def invalidate(self, which):
        if which == "namespace":
            r = self.store.invalidate(namespace="other")
            gone = {k for k in self.present if k in set(keys_of(*CHAINS[3]))}
        elif which == "model_version":
            r = self.store.invalidate(model_version=MV2)
            gone = {k for k in self.present if k in set(keys_of(*CHAINS[4]))}
        else:
            r = self.store.invalidate(namespace="default", dry_run=True)
            assert r.dry_run
            return
        assert r.removed_blocks == len(gone)
        self.present -= gone
        again = self.store.invalidate(namespace="other") if which == "namespace" else self.store.invalidate(model_version=MV2)
        assert again.removed_blocks == 0  # idempotent

    @rule(c=st.integers(0, len(CHAINS) - 1), pinned=st.booleans())
    def set_priority(self, c, pinned):
        tokens, scope = CHAINS[c]
        n = self.store.set_priority(tokens, scope, Priority.PINNED if pinned else Priority.NORMAL)
        assert n == self.expected(c)

    @rule()
    def ephemeral(self):
        tokens, scope = EPHEMERAL_CHAIN
        self.store.put(tokens, pages_for(tokens, scope), scope, priority=Priority.EPHEMERAL)
        assert self.store.lookup(tokens, scope).num_blocks <= 2

    @rule()
    def verify(self):
        r = self.store.verify()
        assert r.corrupt == () and r.checked == len(self.present)

    @precondition(lambda self: not self.leases)
    @rule()
    def reopen(self):
        self.store.close()
        self.store = open_store(self.dir / "home", **self.opts)
        assert self.store.stats()["blocks"] == len(self.present)

    @invariant()
    def integrity(self):
        self.store.check_integrity()
        assert self.store.index.count_blocks() == len(self.present)


StoreMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreMachine = StoreMachine.TestCase
