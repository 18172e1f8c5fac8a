"""The daemon's worker threads, and the store leases waiting to be ended by them.

Store calls that may wait (disk reads, the store lock, puts) run in worker threads so the
event loop never waits. A one-way RELEASE takes its lease out of the lease table on the
loop and ends the store lease there when the store's lock is free (tens of microseconds),
else queues it here: the next store call in any worker ends the queued leases first (no
executor hop of its own), or, when none comes within :data:`RELEASE_DRAIN_S`, a drain does.
So a connection's later request always sees its own releases done.

Thread-safety: :meth:`run`, :meth:`release_soon` and :meth:`release_later` are called on
the event loop; :meth:`_flush` runs in the workers, under a lock, so a store call that
starts while another worker is ending queued leases waits for them.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..results import Lease
from ..store import Store

log = logging.getLogger("tierkv.daemon.handlers")  # the request handlers' log
RELEASE_DRAIN_S = 0.002  # queued releases wait at most this for a store call to end them
T = TypeVar("T")


class Workers:
    """The executor and the queue of store leases to end; owns both."""

    def __init__(self, workers: int) -> None:
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="tierkv-daemon")
        self.unreleased: collections.deque[Lease] = collections.deque()  # store leases to end (any thread)
        self._flush_lock = threading.Lock()
        self._drain_handle: asyncio.TimerHandle | None = None
        self._drains: set[asyncio.Future[None]] = set()

    async def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` in a worker thread, after the releases clients sent without
        waiting (so a connection's later request sees its own releases done)."""
        loop = asyncio.get_running_loop()

        def job() -> T:
            self._flush()
            return fn(*args, **kw)

        return await loop.run_in_executor(self.executor, job)

    def _flush(self) -> None:
        # Always through the lock (uncontended: ~0.1 us): a store call must not start while
        # another worker is still ending leases it popped from the queue.
        with self._flush_lock:
            while self.unreleased:
                lease = self.unreleased.popleft()
                try:
                    lease.store.release(lease)  # the store that issued it
                except Exception:  # noqa: BLE001 - one bad lease must not keep the others pinned
                    log.exception("releasing a lease failed")

    def release_soon(self, leases: list[Lease]) -> None:
        """End store leases now where their store's lock is free (on the loop: a release of
        a few hundred blocks takes tens of microseconds), else queue them
        (:meth:`release_later`); after anything queued, queue too, so that releases end in
        order."""
        if not self.unreleased:
            leases = [lease for lease in leases if not _try_release(lease)]
        if leases:
            self.release_later(leases)

    def release_later(self, leases: list[Lease]) -> None:
        """Queue store leases for the next store call (or a drain) to end. On the loop."""
        self.unreleased.extend(leases)
        if self._drain_handle is None:
            loop = asyncio.get_running_loop()
            self._drain_handle = loop.call_later(RELEASE_DRAIN_S, self._start_drain)

    def _start_drain(self) -> None:
        self._drain_handle = None
        if self.unreleased:
            task = asyncio.ensure_future(self.run(lambda: None))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)

    async def settle(self) -> None:
        """End every queued lease now (stopping, a RELEASE that wants a reply, tests)."""
        await self.run(lambda: None)

    def shutdown(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait)


def _try_release(lease: Lease) -> bool:
    """Release ``lease`` if its store's lock is free now. Every lease the daemon holds was
    issued by a local Store (a ClusterNode's acquire pulls, then leases from its Store);
    a lease of any other store is left to a worker. True also when the release failed
    (logged): it must not be queued and fail again."""
    store = lease.store
    if not isinstance(store, Store):
        return False
    try:
        return store.try_release(lease)
    except Exception:  # noqa: BLE001 - as in Workers._flush: logged, the others still end
        log.exception("releasing a lease failed")
        return True
