"""The lookup's key chain reused by the put that follows it (issue #15: no second hashing):
a remembered key is used only for a byte-equal prefix under the same seed, so a put's keys
are exactly the freshly hashed ones."""
from __future__ import annotations

import numpy as np
import torch

import tierkv.ingest
from tierkv import Scope
from tierkv.identity import ChainMemo, as_token_array, block_keys

from .kit import BS, MV2, SCOPE, keys_of, pages_for, toks

STEP = 4 * BS


def test_memo_proves_only_equal_bytes_under_the_same_seed():
    a = as_token_array(toks(1, 4))
    keys = block_keys(a, SCOPE, BS)
    memo = ChainMemo()
    memo.remember(SCOPE.seed, a.tobytes(), STEP, keys)
    assert memo.proven(SCOPE.seed, a.tobytes(), STEP, 3) == tuple(keys[:3])
    longer = np.concatenate([a, as_token_array(toks(2, 2))])
    assert memo.proven(SCOPE.seed, longer.tobytes(), STEP, 6) == tuple(keys)  # only what it knows
    b = a.copy()
    b[0] += 1  # first block differs: nothing proven
    assert memo.proven(SCOPE.seed, b.tobytes(), STEP, 4) == ()
    assert memo.proven(Scope(MV2).seed, a.tobytes(), STEP, 4) == ()  # another seed
    assert ChainMemo().proven(SCOPE.seed, a.tobytes(), STEP, 4) == ()


def test_put_after_acquire_hashes_only_new_blocks_and_keys_are_exact(make_store, monkeypatch):
    store = make_store()
    shared = toks(10, 2)
    first, second = shared + toks(11, 2), shared + toks(12, 2)
    store.put(first, pages_for(first, SCOPE), SCOPE)
    hashed = []
    real = tierkv.ingest.iter_block_keys

    def counting(tokens, seed, block_size, block_extra=None, start=0, parent=None):
        for k in real(tokens, seed, block_size, block_extra, start=start, parent=parent):
            hashed.append(k)
            yield k

    monkeypatch.setattr(tierkv.ingest, "iter_block_keys", counting)
    with store.acquire(second, SCOPE) as lease:
        hits = lease.num_blocks
    assert hits == 2
    store.put(second, pages_for(second, SCOPE)[hits:], SCOPE, start_block=hits)
    want = keys_of(second)
    assert hashed == want[3:]  # the lookup hashed blocks 0..2 (2 is its first miss)
    assert store.lookup(second, SCOPE).keys == tuple(want)
    # A put of other tokens after that lookup: nothing is reused, keys still exact.
    hashed.clear()
    third = toks(13, 3)
    store.put(third, pages_for(third, SCOPE), SCOPE)
    assert hashed == keys_of(third)
    assert store.lookup(third, SCOPE).keys == tuple(keys_of(third))
    with store.acquire(second, SCOPE) as lease:
        assert lease.num_blocks == 4 and torch.equal(lease.pages(), pages_for(second, SCOPE))
