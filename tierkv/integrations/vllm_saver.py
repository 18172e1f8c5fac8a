"""Saves off vLLM's forward path: a bounded queue of copied pages and one writer thread.

``wait_for_save`` runs inside the engine step, so it only copies the new full blocks out of
vLLM's KV cache (:meth:`SaveQueue.submit`) and returns; the durable put (hashing, writing,
fsync, index commit) happens on the writer thread. Once the copy is made, vLLM may free or
reuse its blocks. The queue is bounded in bytes: when the writer falls behind (a slow disk, a
hung daemon), a save that does not fit is dropped and counted rather than stalling the engine
- tierkv is a cache, and a dropped save is a later miss.

Saves of one request are written in the order they were submitted (one thread, FIFO), so a
chain is put front to back. A save whose earlier blocks were dropped is still written; the
store serves a prefix only up to its first missing block, so it is unreachable until they are
stored again, never wrong.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..identity import Scope

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingSave:
    """Pages copied out of vLLM, waiting to be put as chain blocks ``first_block ..``."""

    req_id: str
    token_ids: tuple[int, ...]
    scope: Scope
    first_block: int
    pages: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()


Put = Callable[[PendingSave], bool]  # True: stored (or already there); False: failed


class SaveQueue:
    """FIFO of :class:`PendingSave` under ``max_bytes``, drained by one daemon thread.

    ``put`` is called on the writer thread only. Counters: ``dropped`` saves (queue full),
    ``failed`` puts, ``saved_blocks``. :meth:`flush` waits until the queue is empty;
    :meth:`close` flushes (up to a timeout) and stops the thread.
    """

    def __init__(self, put: Put, max_bytes: int) -> None:
        self._put = put
        self.max_bytes = max_bytes
        self._queue: deque[PendingSave] = deque()
        self._queued_bytes = 0
        self._inflight: PendingSave | None = None  # taken off the queue, being written
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self.dropped_blocks = 0
        self.failed = 0
        self.saved_blocks = 0
        self._thread = threading.Thread(target=self._run, name="tierkv-vllm-saver", daemon=True)
        self._thread.start()

    def submit(self, save: PendingSave) -> bool:
        """Queue ``save``; False (and counted) when it does not fit or the queue is closed."""
        with self._cond:
            if self._closed or self._queued_bytes + save.nbytes > self.max_bytes:
                self.dropped += 1
                self.dropped_blocks += save.pages.shape[0]
                return False
            self._queue.append(save)
            self._queued_bytes += save.nbytes
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                save = self._inflight = self._queue.popleft()
            ok = False
            try:
                ok = self._put(save)
            except Exception as e:  # the put callback turns store errors into False already
                log.warning("tierkv save of %s failed: %s: %s", save.req_id, type(e).__name__, e)
            with self._cond:
                self._inflight = None
                self._queued_bytes -= save.nbytes
                if ok:
                    self.saved_blocks += save.pages.shape[0]
                else:
                    self.failed += 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._inflight is None, timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the writer."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._cond.notify_all()
        if left:
            log.warning("tierkv: %d queued saves not written at shutdown", left)
        self._thread.join(timeout)

    def check_integrity(self) -> None:
        with self._cond:
            inflight = self._inflight.nbytes if self._inflight is not None else 0
            assert self._queued_bytes == sum(s.nbytes for s in self._queue) + inflight, self._queued_bytes
            assert self._queued_bytes <= self.max_bytes, (self._queued_bytes, self.max_bytes)
