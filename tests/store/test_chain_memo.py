"""The lookup's key chain reused by the put that follows it (issue #15: no second hashing):
a remembered key is used only for a byte-equal prefix under the same seed, so a put's keys
are exactly the freshly hashed ones."""
from __future__ import annotations

import numpy as np
import torch

import tierkv.identity
import tierkv.matching
from tierkv import Scope
from tierkv.identity import ChainMemo, as_token_array, block_keys, same_bytes

from .kit import BS, MV2, SCOPE, keys_of, pages_for, toks

STEP = 4 * BS


def counting_keys(real, hashed: list):
    """``real`` (an iter_block_keys) that records every key it yields in ``hashed``."""
    def counting(tokens, seed, block_size, block_extra=None, start=0, parent=None, raw=None):
        for k in real(tokens, seed, block_size, block_extra, start=start, parent=parent, raw=raw):
            hashed.append(k)
            yield k

    return counting


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
    third = toks(13, 3)
    # Expected keys and pages made before hashing is counted (the helpers hash too).
    want, third_keys = keys_of(second), keys_of(third)
    second_pages, third_pages = pages_for(second, SCOPE), pages_for(third, SCOPE)
    hashed = []
    # The put's keys come from ChainMemo.chain_keys (tierkv/identity.py), which hashes the rest.
    monkeypatch.setattr(tierkv.identity, "iter_block_keys", counting_keys(tierkv.identity.iter_block_keys, hashed))
    with store.acquire(second, SCOPE) as lease:
        hits = lease.num_blocks
    assert hits == 2
    store.put(second, second_pages[hits:], SCOPE, start_block=hits)
    # The lookup proved blocks 0-1 from the memo and hashed block 2, its first miss, which it
    # does not remember (tierkv/placement.py, match): the put hashes its new blocks, no more.
    assert hashed == want[2:]
    assert store.lookup(second, SCOPE).keys == tuple(want)
    # A put of other tokens after that lookup: nothing is reused, keys still exact.
    hashed.clear()
    store.put(third, third_pages, SCOPE)
    assert hashed == third_keys
    assert store.lookup(third, SCOPE).keys == tuple(keys_of(third))
    with store.acquire(second, SCOPE) as lease:
        assert lease.num_blocks == 4 and torch.equal(lease.pages(), pages_for(second, SCOPE))


def test_memo_proves_the_longest_common_prefix_of_several_chains():
    shared = toks(20, 1)
    a = as_token_array(shared + toks(21, 3))
    b = as_token_array(shared + toks(22, 2))
    memo = ChainMemo()
    memo.remember(SCOPE.seed, a.tobytes(), STEP, block_keys(a, SCOPE, BS))
    memo.remember(SCOPE.seed, b.tobytes(), STEP, block_keys(b, SCOPE, BS))
    c = as_token_array(list(a[: 3 * BS]) + toks(23, 2))
    assert memo.proven(SCOPE.seed, c.tobytes(), STEP, 5) == tuple(block_keys(c, SCOPE, BS)[:3])
    d = as_token_array(list(b[: 2 * BS]) + toks(24, 1))
    assert memo.proven(SCOPE.seed, d.tobytes(), STEP, 3) == tuple(block_keys(d, SCOPE, BS)[:2])
    e = as_token_array(shared + toks(25, 2))  # only the first block in common with either
    assert memo.proven(SCOPE.seed, e.tobytes(), STEP, 3) == tuple(block_keys(e, SCOPE, BS)[:1])


def test_memo_is_bounded_and_forgets_the_least_recent():
    memo = ChainMemo(max_bytes=8 * STEP)
    arrays = [as_token_array(toks(100 + i, 4)) for i in range(5)]
    for arr in arrays:
        memo.remember(SCOPE.seed, arr.tobytes(), STEP, block_keys(arr, SCOPE, BS))
    assert memo._bytes <= 8 * STEP
    assert memo.proven(SCOPE.seed, arrays[0].tobytes(), STEP, 4) == ()  # the oldest is gone
    assert memo.proven(SCOPE.seed, arrays[-1].tobytes(), STEP, 4) == tuple(block_keys(arrays[-1], SCOPE, BS))


def test_a_repeated_prompt_is_not_hashed_again_and_bad_stored_tokens_are_still_caught(make_store, monkeypatch):
    store = make_store()
    t = toks(30, 3)
    store.put(t, pages_for(t, SCOPE), SCOPE)
    hashed = []
    monkeypatch.setattr(tierkv.matching, "iter_block_keys", counting_keys(tierkv.matching.iter_block_keys, hashed))
    assert store.lookup(t, SCOPE).keys == tuple(keys_of(t))
    assert hashed == []  # the put's keys proved the whole prompt
    longer = t + toks(31, 1)
    assert store.lookup(longer, SCOPE).num_blocks == 3
    assert hashed == keys_of(longer)[3:]  # only the new block
    # A stored block whose token ids no longer match (a corrupt record) is found and
    # quarantined although the memo proves the keys: the ids are compared all the same.
    b = store.placement.table.get(keys_of(t)[1])
    b.tokens = bytes(len(b.tokens))
    assert store.lookup(t, SCOPE).num_blocks == 1
    assert store.stats()["quarantined"] == 1


def test_memo_proves_up_to_the_first_differing_block_wherever_it_is():
    # The proof bisects over whole blocks: a prompt that leaves a 37-block chain at block j
    # (one token changed, at the block's first or last byte) is proven for exactly j blocks.
    chain = as_token_array(toks(30, 37))
    keys = tuple(block_keys(chain, SCOPE, BS))
    memo = ChainMemo()
    memo.remember(SCOPE.seed, chain.tobytes(), STEP, keys)
    for j in range(1, 37):
        for at in (j * BS, (j + 1) * BS - 1):
            other = chain.copy()
            other[at] += 1
            assert memo.proven(SCOPE.seed, other.tobytes(), STEP, 37) == keys[:j], (j, at)
            assert memo.proven(SCOPE.seed, other.tobytes(), STEP, j + 1) == keys[:j], (j, at)
    assert memo.proven(SCOPE.seed, chain.tobytes(), STEP, 37) == keys


def test_memo_takes_byte_views_and_keeps_its_own_copy():
    # Lookups and puts hand the memo a view of the caller's array, not a copy: it must prove
    # the same keys as from bytes, and what it remembers must not follow later changes to
    # the caller's array (a key is reused only for the bytes it was computed from).
    chain = as_token_array(toks(40, 6))
    keys = tuple(block_keys(chain, SCOPE, BS))
    view = chain.data.cast("B")
    memo = ChainMemo()
    memo.remember(SCOPE.seed, view, STEP, keys)
    assert memo.proven(SCOPE.seed, view, STEP, 6) == keys
    assert memo.proven(SCOPE.seed, chain.tobytes(), STEP, 6) == keys
    original = chain.tobytes()
    chain[3 * BS] += 1  # the caller reuses its array: block 3 differs now
    assert memo.proven(SCOPE.seed, view, STEP, 6) == keys[:3]
    assert memo.proven(SCOPE.seed, original, STEP, 6) == keys


def test_same_bytes_compares_bytes_with_views_by_length_and_content():
    a = np.arange(8, dtype="<i4")
    view = a.data.cast("B")
    assert same_bytes(a.tobytes(), view)
    assert not same_bytes(a.tobytes()[:-4], view)  # a prefix is not equal
    assert not same_bytes(a.tobytes() + b"\0", view)
    b = a.copy()
    b[-1] += 1
    assert not same_bytes(b.tobytes(), view)


def test_a_stored_block_keeps_its_own_token_ids_when_the_callers_array_changes(make_store):
    store = make_store()
    tokens = toks(50, 3)
    arr = as_token_array(tokens)  # int32 and contiguous already: the store reads this very array
    store.put(arr, pages_for(tokens, SCOPE), SCOPE)
    arr[:] = 7  # the caller reuses its buffer
    with store.acquire(tokens, SCOPE) as lease:
        assert lease.num_blocks == 3 and torch.equal(lease.pages(), pages_for(tokens, SCOPE))
    assert store.lookup(arr, SCOPE).num_blocks == 0
    store.check_integrity()


def test_store_block_keys_are_exact_and_reuse_what_a_put_hashed(make_store, monkeypatch):
    """``Store.block_keys`` (the cluster publisher's keys after a put): the keys identity
    gives, any prefix of them, with or without block extras, and none hashed again for a
    prompt the store just stored."""
    store = make_store()
    prompt = toks(40, 3)
    want, pages = keys_of(prompt), pages_for(prompt, SCOPE)
    extra = [["img-a"], ["img-b"], []]
    want_extra = block_keys(prompt, SCOPE, BS, extra)
    store.put(prompt, pages, SCOPE)
    hashed = []
    monkeypatch.setattr(tierkv.identity, "iter_block_keys", counting_keys(tierkv.identity.iter_block_keys, hashed))
    assert store.block_keys(prompt, SCOPE) == want
    assert store.block_keys(prompt, SCOPE, 2) == want[:2]
    assert hashed == []  # all from the chain memo
    assert store.block_keys(prompt, SCOPE, block_extra=extra) == want_extra  # extras: hashed, never proved
    assert hashed == want_extra
