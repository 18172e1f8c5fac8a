"""tierkv.lease_windows: windows in order, the reads ahead of the consumer, and every lease
released whichever way the consumer leaves."""
from __future__ import annotations

import threading

import pytest
import torch

from store.kit import BS, LAYOUT, SCOPE, open_store, pages_for, put_chain, toks
from tierkv.layout import kv_buffer, unpack_pages
from tierkv.lease_windows import LeaseWindows

N = 10  # blocks of the chain
# One reader thread, and two leasing windows at once (as a restore does): the same answers.
READERS = pytest.mark.parametrize("readers", [1, 2])


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "home", shm_dir=tmp_path / "shm", device_bytes=16 * LAYOUT.page_bytes,
                   host_bytes=0, disk_bytes=64 * LAYOUT.slot_bytes)
    yield s
    s.check_integrity()
    s.close()


@READERS
def test_windows_in_order_hold_the_stored_pages(readers, store):
    tokens = toks(1, N)
    put_chain(store, tokens)
    kv = kv_buffer(LAYOUT, N)
    sizes = []
    with LeaseWindows(store, tokens, SCOPE, N, window_blocks=3, ahead=2, readers=readers) as windows:
        got = 0
        for lease in windows:
            try:
                sizes.append(lease.num_blocks)
                lease.kv_into(kv, got)
                got += lease.num_blocks
            finally:
                lease.release()
    assert sizes == [3, 3, 3, 1]
    want = unpack_pages(pages_for(tokens), LAYOUT)
    for layer, (k, v) in enumerate(want):
        assert torch.equal(kv[layer, 0], k) and torch.equal(kv[layer, 1], v)
    assert store.stats()["leased_blocks"] == 0


@READERS
def test_reads_run_ahead_of_a_slow_consumer(readers, store):
    """While the consumer holds the first window, the reader leases the next ``ahead`` ones."""
    tokens = toks(2, N)
    put_chain(store, tokens)
    with LeaseWindows(store, tokens, SCOPE, N, window_blocks=2, ahead=2, readers=readers) as windows:
        it = iter(windows)
        first = next(it)
        pause = threading.Event()
        for _ in range(200):  # the reader leases two windows ahead while we hold the first
            if store.stats()["leased_blocks"] >= 2 + 2 * 2:
                break
            pause.wait(0.01)
        pause.wait(0.1)
        assert store.stats()["leased_blocks"] == 2 + 2 * 2  # the held window and two ahead, no more
        windows.check_integrity()
        first.release()
        rest = list(it)
        for lease in rest:
            lease.release()
    assert sum(lease.num_blocks for lease in rest) == N - 2
    assert store.stats()["leased_blocks"] == 0


@READERS
def test_stopping_early_releases_the_windows_read_ahead(readers, store):
    tokens = toks(3, N)
    put_chain(store, tokens)
    with pytest.raises(RuntimeError, match="copy failed"):
        with LeaseWindows(store, tokens, SCOPE, N, window_blocks=2, ahead=3, readers=readers) as windows:
            for lease in windows:
                lease.release()
                raise RuntimeError("copy failed")
    assert store.stats()["leased_blocks"] == 0
    with LeaseWindows(store, tokens, SCOPE, N, window_blocks=2, readers=readers) as windows:
        first = next(iter(windows))
        first.release()  # leaving the block early: close() releases the rest
    assert store.stats()["leased_blocks"] == 0


@READERS
def test_the_chain_ends_at_the_first_missing_block(readers, store):
    """Blocks 0-5 stored, 7-9 stored under a gap at 6: iteration stops inside the window
    that reaches the gap, and nothing after it is leased."""
    tokens = toks(4, N)
    pages = pages_for(tokens)
    store.put(tokens[: 6 * BS], pages[:6], SCOPE)
    store.put(tokens, pages[7:], SCOPE, start_block=7)
    sizes = []
    with LeaseWindows(store, tokens, SCOPE, N, window_blocks=4, readers=readers) as windows:
        for lease in windows:
            sizes.append(lease.num_blocks)
            lease.release()
    assert sizes == [4, 2]
    assert store.stats()["leased_blocks"] == 0


@READERS
def test_an_acquire_error_is_raised_after_the_windows_before_it(readers, store, monkeypatch):
    tokens = toks(5, N)
    put_chain(store, tokens)
    real = store.acquire
    calls = []

    def failing(*args, **kwargs):
        calls.append(kwargs["start_block"])
        if kwargs["start_block"] >= 4:
            raise OSError(5, "simulated acquire failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "acquire", failing)
    seen = []
    with pytest.raises(OSError, match="simulated"):
        with LeaseWindows(store, tokens, SCOPE, N, window_blocks=2, readers=readers) as windows:
            for lease in windows:
                seen.append(lease.num_blocks)
                lease.release()
    assert seen == [2, 2]
    # Two readers: the window after the failing one may have been claimed meanwhile.
    assert calls == [0, 2, 4] if readers == 1 else sorted(calls)[:3] == [0, 2, 4] and set(calls) <= {0, 2, 4, 6}
    assert store.stats()["leased_blocks"] == 0


def test_two_readers_hand_windows_out_in_order_when_a_later_one_is_read_first(store, monkeypatch):
    """The first window's acquire is slow: the second reader leases the next windows first;
    they wait, and the consumer still gets blocks 0, 1, ... in order."""
    import time

    tokens = toks(6, N)
    put_chain(store, tokens)
    real = store.acquire
    finished = []

    def slow_first(*args, **kwargs):
        if kwargs["start_block"] == 0:
            time.sleep(0.2)
        lease = real(*args, **kwargs)
        finished.append(kwargs["start_block"])
        return lease

    monkeypatch.setattr(store, "acquire", slow_first)
    starts = []
    with LeaseWindows(store, tokens, SCOPE, N, window_blocks=2, ahead=3, readers=2) as windows:
        for lease in windows:
            starts.append(lease.start_block)
            windows.check_integrity()
            lease.release()
    assert finished[0] != 0  # a later window was leased first ...
    assert starts == [0, 2, 4, 6, 8]  # ... and handed out after the first
    assert store.stats()["leased_blocks"] == 0
