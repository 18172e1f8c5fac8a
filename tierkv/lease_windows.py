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

import queue
import threading
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    import numpy as np

    from .identity import Scope

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class LeaseWindows:
    """``with LeaseWindows(store, tokens, scope, blocks) as windows: for lease in windows:``
    leases of blocks ``0 .. blocks-1`` of ``tokens`` (an int32 array is sliced without a
    copy for each window) in order, ``window_blocks`` at a time
    (the last may be shorter; iteration stops after a window shorter than asked). An error of
    an ``acquire`` is raised by the iteration, after the windows before it."""

    def __init__(self, store: Any, tokens: "Sequence[int] | np.ndarray", scope: "Scope", blocks: int, *,
                 window_blocks: int = 32, ahead: int = 3, promote: bool = True) -> None:
        self.store, self.tokens, self.scope, self.blocks = store, tokens, scope, blocks
        self.promote = promote  # passed to each acquire (False: the consumer copies, then releases)
        self.window_blocks = max(1, window_blocks)
        self.ahead = max(1, ahead)
        self._queue: queue.Queue[Any] = queue.Queue()
        # One permit per window read but not yet handed out (the one being read included).
        self._permits = threading.Semaphore(self.ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="tierkv-lease-windows", daemon=True)
        self._drained = False  # _DONE taken off the queue: the reader has ended

    def __enter__(self) -> "LeaseWindows":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> None:
        bs = self.store.layout.block_size
        start = 0
        try:
            while start < self.blocks:
                self._permits.acquire()
                if self._stop.is_set():
                    break
                end = min(start + self.window_blocks, self.blocks)
                lease = self.store.acquire(self.tokens[: end * bs], self.scope, max_blocks=end - start,
                                           start_block=start, promote=self.promote)
                self._queue.put(lease)
                if lease.num_blocks < end - start:
                    break  # the chain ends inside this window
                start = end
        except BaseException as e:  # handed to the consumer, raised there
            self._queue.put(_Failed(e))
        finally:
            self._queue.put(_DONE)

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                self._drained = True
                return
            if isinstance(item, _Failed):
                raise item.error
            self._permits.release()
            if not item.num_blocks:
                item.release()
                return
            yield item

    def check_integrity(self) -> None:
        """Windows read but not handed out never exceed ``ahead`` (the queue may also hold
        the reader's error and its end marker)."""
        queued = [item for item in list(self._queue.queue) if item is not _DONE and not isinstance(item, _Failed)]
        assert len(queued) <= self.ahead, f"{len(queued)} windows read ahead, at most {self.ahead} allowed"

    def close(self) -> None:
        """Stop reading and release every window read but not handed out."""
        self._stop.set()
        if self._thread.ident is None:
            return  # never started: nothing was read
        self._permits.release()  # a reader waiting for a permit wakes, sees the stop, ends
        while not self._drained:
            item = self._queue.get()  # the reader always ends with _DONE
            if item is _DONE:
                self._drained = True
            elif not isinstance(item, _Failed):
                item.release()
        self._thread.join()
