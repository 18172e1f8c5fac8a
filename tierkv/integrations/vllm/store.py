"""The connector's access to tierkv, where every failure becomes a miss.

vLLM must never fail a request because of the cache: a lookup that raises, times out or
finds a dead daemon answers "0 tokens"; an acquire that fails loads nothing; a put that
fails is dropped. Each such event is logged (once per kind) and counted, and vLLM recomputes.

An embedded home is opened once per process and shared by the scheduler-side and
worker-side connector objects of one engine (``distributed_executor_backend="uni"``
runs both in one process); a home can only be opened by one process at a time, so engines
with separate worker processes use a daemon (``socket``) instead.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...backoff import Backoff
from ...identity import Scope
from ...layout import PageLayout
from ...results import LookupResult
from ...lease import Lease
from .config import ConnectorConfig

log = logging.getLogger(__name__)
# After a failure the store is left alone for RETRY_MIN_S, doubling per consecutive failure up
# to RETRY_MAX_S: a hung daemon then costs one timeout per minute, not one per request.
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0

MISS = LookupResult(0, (), ())
_shared_lock = threading.Lock()
_shared: dict[str, list[Any]] = {}  # resolved home -> [store, refcount]


def _open_shared(cfg: ConnectorConfig, layout: PageLayout) -> Any:
    import tierkv
    from pathlib import Path

    key = str(Path(cfg.home).resolve())  # type: ignore[arg-type]
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            # The engine's first request comes seconds after this open (weights, KV cache,
            # warm-up): warm_at_open reads back what the device tier held when the engine last
            # stopped, and populate_device_ahead faults in where reads land (StoreConfig).
            store = tierkv.open(cfg.home, layout, device="cpu", device_bytes=cfg.device_bytes,  # type: ignore[arg-type]
                                host_bytes=cfg.host_bytes, disk_bytes=cfg.disk_bytes, populate_device_ahead=True,
                                warm_at_open=cfg.warm_at_open)
            entry = _shared[key] = [store, 0]
        entry[1] += 1
        return entry[0]


def _warm(store: Any, tokens: list[int], scope: Scope, start_block: int, max_blocks: int) -> int:
    with store.acquire(tokens, scope, max_blocks=max_blocks, start_block=start_block) as lease:
        return lease.num_blocks


def _close_shared(store: Any) -> None:
    with _shared_lock:
        for key, entry in list(_shared.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] == 0:
                    del _shared[key]
                    store.close()
                return


class StoreHandle:
    """A store or daemon client for one connector object, with failures turned into misses.

    ``errors`` counts every call that failed. The store is (re)opened lazily; after a
    failure, calls answer "miss" without trying for a back-off period (see
    :data:`RETRY_MIN_S`), so a daemon restarted under a running engine is picked up again and
    a dead or hung one does not stall vLLM's scheduler on every request.
    """

    def __init__(self, config: ConnectorConfig, layout: PageLayout) -> None:
        self.config = config
        self.layout = layout
        self.errors = 0
        self._store: Any = None
        # The clock is looked up at each call (tests patch time.monotonic).
        self._backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S, clock=lambda: time.monotonic())
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._prefetch_pool: ThreadPoolExecutor | None = None

    # ---- opening -----------------------------------------------------------------------
    def _get(self) -> Any:
        with self._lock:
            if self._store is not None:
                return self._store
            if not self._backoff.ready():
                return None
            try:
                self._store = self._open()
            except Exception as e:
                self._fail("open", e)
                self._back_off()
            return self._store

    def _back_off(self) -> None:
        # Held: self._lock.
        self._backoff.failed()

    def _succeeded(self) -> None:
        self._backoff.succeeded()

    def _open(self) -> Any:
        if self.config.home is not None:
            return _open_shared(self.config, self.layout)
        import tierkv

        # The layout of vLLM's actual KV cache is declared to the daemon, which opens a store
        # for it on first use: a daemon started with only --home and --socket serves any model.
        client = tierkv.connect(self.config.socket, layout=self.layout,  # type: ignore[arg-type]
                                timeout=self.config.timeout_s, connect_timeout=min(5.0, self.config.timeout_s))
        if client.layout != self.layout:  # a daemon of an older tierkv serves one fixed layout
            client.close()
            raise ValueError(f"the daemon serves pages of layout {client.layout}, this model needs {self.layout}")
        return client

    def _fail(self, what: str, e: BaseException) -> None:
        self.errors += 1
        if what not in self._warned:
            self._warned.add(what)
            log.warning("tierkv %s failed, vLLM recomputes instead: %s: %s", what, type(e).__name__, e)
        else:
            log.debug("tierkv %s failed: %s", what, e)

    def _drop_client(self, e: BaseException) -> None:
        # A daemon client whose connection failed may be dead: reconnect on a later call,
        # after the back-off. Errors about one call (bad tokens, a full tier) and every error
        # of an embedded store leave the store in place.
        from ...errors import DaemonUnavailableError, ProtocolError, TierKVError

        per_call = isinstance(e, TierKVError) and not isinstance(e, (DaemonUnavailableError, ProtocolError))
        if self.config.socket is not None and not per_call:
            with self._lock:
                store, self._store = self._store, None
                self._back_off()
            if store is not None:
                try:
                    store.close()
                except Exception:
                    pass

    # ---- the calls the connector makes --------------------------------------------------
    def lookup(self, tokens: list[int] | np.ndarray, scope: Scope) -> LookupResult:
        """The longest stored prefix (tokens a multiple of the block size, and the tier of
        each block); an empty result on failure."""
        store = self._get()
        if store is None:
            return MISS
        try:
            found = store.lookup(tokens, scope)
            self._succeeded()
            return LookupResult(int(found.tokens_matched), tuple(found.keys), tuple(found.tiers))
        except Exception as e:
            self._fail("lookup", e)
            self._drop_client(e)
            return MISS

    def acquire(self, tokens: list[int], scope: Scope, max_blocks: int, start_block: int = 0) -> Lease | None:
        """A lease on up to ``max_blocks`` blocks of the cached prefix from ``start_block``
        on, or None on failure. The caller releases it (``with``)."""
        store = self._get()
        if store is None:
            return None
        try:
            return store.acquire(tokens, scope, max_blocks=max_blocks, start_block=start_block)
        except Exception as e:
            self._fail("acquire", e)
            self._drop_client(e)
            return None

    def prefetch(self, tokens: list[int], scope: Scope, start_block: int, max_blocks: int) -> None:
        """Start promoting blocks ``start_block ..`` (at most ``max_blocks``) of the cached
        prefix into the device tier, without waiting; failures are logged and counted."""
        store = self._get()
        if store is None:
            return
        try:
            if self.config.home is not None:
                # Embedded: lease just the window on a helper thread (Store.prefetch warms the
                # whole prefix, including blocks vLLM holds itself).
                future = self._prefetcher().submit(_warm, store, tokens, scope, start_block, max_blocks)
            else:
                future = store.prefetch(tokens, scope)
        except Exception as e:
            self._fail("prefetch", e)
            return
        future.add_done_callback(self._prefetched)

    def _prefetched(self, future: Future) -> None:
        e = future.exception()
        if e is not None:
            self._fail("prefetch", e)

    def _prefetcher(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._prefetch_pool is None:
                self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-vllm-prefetch")
            return self._prefetch_pool

    def put(self, tokens: list[int], pages: torch.Tensor, scope: Scope, start_block: int) -> bool:
        """Store pages of blocks ``start_block..``; False when it failed (nothing to undo)."""
        store = self._get()
        if store is None:
            return False
        try:
            store.put(tokens, pages, scope, start_block=start_block)
            return True
        except Exception as e:
            self._fail("put", e)
            self._drop_client(e)
            return False

    def stats(self) -> dict[str, object]:
        store = self._get()
        if store is None:
            return {}
        try:
            out = dict(store.stats())
            warm = getattr(store, "warm_start", None)  # an embedded store's (a daemon's: stats()["daemon"])
            if warm is not None:
                out["warm_start"] = warm.stats()
            return out
        except Exception as e:
            self._fail("stats", e)
            return {}

    def open(self) -> bool:
        """Open the store (or connect to the daemon) now, when the connector starts, so no
        request pays for it; False when that failed (retried after the back-off)."""
        return self._get() is not None

    def close(self) -> None:
        with self._lock:
            pool, self._prefetch_pool = self._prefetch_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            store, self._store = self._store, None
        if store is None:
            return
        if self.config.home is not None:
            _close_shared(store)
        else:
            store.close()
