"""Leasing a long stored prefix in windows, the reads running ahead of their consumer.

A restore copies leased pages out of the store; leasing a whole 4,096-token prefix at once
makes the copy wait for the last read. :class:`LeaseWindows` leases windows of
``window_blocks`` blocks one after another on a helper thread and hands them over in order,
up to ``ahead`` windows ahead of the consumer, so the disk reads (and their checksums, on the
store's own helper thread) run back to back while the consumer copies the windows already
read. Only the copy of the last window is left after the last read.

Ownership: a window handed out by iteration belongs to the consumer, who releases it (after
copying it). Windows read but not handed out, when the consumer stops early or raises, are
released by :meth:`LeaseWindows.close` (the ``with`` block's exit). The chain ends at the
first window shorter than asked (a block evicted, corrupt, or a full device tier): nothing
after a missing block can be served.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    import numpy as np

    from .identity import Scope


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class LeaseWindows:
    """``with LeaseWindows(store, tokens, scope, blocks) as windows: for lease in windows:``
    leases of blocks ``0 .. blocks-1`` of ``tokens`` (an int32 array is sliced without a
    copy for each window) in order, ``window_blocks`` at a time
    (the last may be shorter; iteration stops after a window shorter than asked). An error of
    an ``acquire`` is raised by the iteration, after the windows before it.

    ``readers`` helper threads lease windows at once (each the next one not yet claimed),
    so the disk is never idle between two windows: with one, it was while a window's last
    checksums finished and the next acquire looked its blocks up (~2 ms of each 23 MiB
    window's ~15 on the VM of docs/performance.md)."""

    def __init__(self, store: Any, tokens: "Sequence[int] | np.ndarray", scope: "Scope", blocks: int, *,
                 window_blocks: int = 32, ahead: int = 3, promote: bool = True, readers: int = 1) -> None:
        self.store, self.tokens, self.scope, self.blocks = store, tokens, scope, blocks
        self.promote = promote  # passed to each acquire (False: the consumer copies, then releases)
        self.window_blocks = max(1, window_blocks)
        self.ahead = max(1, ahead)
        # One permit per window read but not yet handed out (those being read included).
        self._permits = threading.Semaphore(self.ahead)
        self._stop = threading.Event()
        # Guarded by _cond: the next window to claim, the windows read (index -> lease or
        # _Failed) not yet handed out, the first window that ended the chain, live readers.
        self._cond = threading.Condition()
        self._claimed = 0
        self._results: dict[int, Any] = {}
        self._end: int | None = None
        self._threads = [threading.Thread(target=self._read, name=f"tierkv-lease-windows-{i}", daemon=True)
                         for i in range(max(1, readers))]
        self._live = len(self._threads)

    def __enter__(self) -> "LeaseWindows":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> None:
        bs, n = self.store.layout.block_size, self.window_blocks
        try:
            while True:
                self._permits.acquire()
                with self._cond:
                    if self._stop.is_set() or self._end is not None or self._claimed * n >= self.blocks:
                        return
                    index = self._claimed
                    self._claimed += 1
                start = index * n
                end = min(start + n, self.blocks)
                try:
                    item: Any = self.store.acquire(self.tokens[: end * bs], self.scope, max_blocks=end - start,
                                                   start_block=start, promote=self.promote)
                    ends = item.num_blocks < end - start  # the chain ends inside this window
                except BaseException as e:  # handed to the consumer, raised there
                    item, ends = _Failed(e), True
                with self._cond:
                    self._results[index] = item
                    if ends:
                        self._end = index if self._end is None else min(self._end, index)
                    self._cond.notify_all()
                if ends:
                    return
        finally:
            with self._cond:
                self._live -= 1
                self._cond.notify_all()

    def __iter__(self) -> Iterator[Any]:
        index = 0
        while True:
            with self._cond:
                while True:
                    if self._end is not None and index > self._end:
                        item = None  # after the window that ended the chain: close() releases it
                        break
                    if index in self._results:
                        item = self._results.pop(index)
                        break
                    if self._live == 0:
                        item = None
                        break
                    self._cond.wait()
            if item is None:
                return
            if isinstance(item, _Failed):
                raise item.error
            self._permits.release()
            if not item.num_blocks:
                item.release()
                return
            yield item
            index += 1

    def check_integrity(self) -> None:
        """Windows read but not handed out never exceed ``ahead``."""
        with self._cond:
            queued = [item for item in self._results.values() if not isinstance(item, _Failed)]
        assert len(queued) <= self.ahead, f"{len(queued)} windows read ahead, at most {self.ahead} allowed"

    def close(self) -> None:
        """Stop reading and release every window read but not handed out."""
        self._stop.set()
        started = [t for t in self._threads if t.ident is not None]
        if not started:
            return  # never started: nothing was read
        for _ in started:
            self._permits.release()  # a reader waiting for a permit wakes, sees the stop, ends
        for t in started:
            t.join()
        with self._cond:
            left, self._results = list(self._results.values()), {}
        for item in left:
            if not isinstance(item, _Failed):
                item.release()
