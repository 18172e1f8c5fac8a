"""The remote tier: whole pages in a cluster-wide Mooncake Store, shared by every node.

One object per block, named ``key_prefix + block_key.hex()``: tierkv's own metadata in a header
in front of the page bytes (the format: :mod:`tierkv.cluster.remote_object`).

Every fetch verifies the header checksum, the key, the layout, the expected model version,
namespace, parent and token ids, and the page checksum (seeded by the key). A failure is a
miss, counted under ``verify_failed``; the bad object is removed.

Faults never reach a request. Each client call runs on a worker thread with a deadline; an
error, a negative status or a missed deadline marks the tier *down* with a counted reason,
and while it is down every call answers "miss" or "not published" at once. After a backoff
(doubling up to ``backoff_max_s``) the next call probes the master and the tier comes back
up; a client whose call hung, or whose setup failed, is replaced by a fresh one.
Rejected: retrying inside a request (a dead master would add seconds to every prefill).
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from ..backoff import Backoff
from ..layout import PageLayout
from .remote_object import (  # noqa: F401  (re-exported: the object format lives there)
    BadObject, RemoteMeta, RemotePage, RemotePutResult, decode_object, encode_object, layout_info,
)

log = logging.getLogger(__name__)

EXISTS_BATCH = 1024  # keys per existence call: bounds one RPC message
_KEY_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:/-]{0,128}$")


@dataclass(frozen=True)
class RemoteConfig:
    """Where the Mooncake master is and how this node joins it.

    ``metadata_url`` is the transfer engine's metadata service (the master's embedded HTTP
    server: ``http://HOST:PORT/metadata``); ``local_hostname`` the address other nodes
    reach this node's segment on. ``global_segment_bytes`` is what this node lends to the
    cluster pool (0: a pure client); ``local_buffer_bytes`` bounds one batched put or get.
    """

    master_address: str
    metadata_url: str
    local_hostname: str = "127.0.0.1"
    key_prefix: str = "tierkv/"
    global_segment_bytes: int = 512 << 20
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    device_name: str = ""
    op_timeout_s: float = 5.0
    setup_timeout_s: float = 10.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    remove_corrupt: bool = True

    def __post_init__(self) -> None:
        if not self.master_address or ":" not in self.master_address:
            raise ValueError(f"master_address must be HOST:PORT, got {self.master_address!r}")
        if not _KEY_PREFIX_RE.match(self.key_prefix):
            raise ValueError(f"key_prefix must be at most 128 of [A-Za-z0-9_.:/-], got {self.key_prefix!r}")
        for name in ("global_segment_bytes", "local_buffer_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int")
        if self.local_buffer_bytes < 1 << 20:
            raise ValueError("local_buffer_bytes must be at least 1 MiB")
        for name in ("op_timeout_s", "setup_timeout_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


class RemoteBackend(Protocol):
    """The few client calls the tier uses (MooncakeDistributedStore's names). Status codes:
    0 ok, negative an error; ``batch_is_exist`` gives 1, 0 or a negative error per key."""

    def put_batch(self, keys: list[str], values: list[bytes]) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def get_batch(self, keys: list[str]) -> list[bytes]: ...
    def remove(self, key: str) -> int: ...
    def close(self) -> int: ...


def mooncake_backend(config: RemoteConfig) -> RemoteBackend:
    """A set-up Mooncake client. Raises ImportError without mooncake, OSError when the
    master does not answer or setup fails."""
    from mooncake.store import MooncakeDistributedStore

    # Mooncake 0.3.13's setup() blocks for ~90 s *holding the GIL* when the master is not
    # there, so no deadline on our side could cut it short: ask the master first.
    check_master(config, timeout_s=min(2.0, config.setup_timeout_s))
    client = MooncakeDistributedStore()
    rc = client.setup(config.local_hostname, config.metadata_url, config.global_segment_bytes,
                      config.local_buffer_bytes, config.protocol, config.device_name, config.master_address)
    if rc != 0:
        raise OSError(f"mooncake setup returned {rc} (master {config.master_address})")
    return client  # type: ignore[no-any-return]


def check_master(config: RemoteConfig, timeout_s: float) -> None:
    """Raise OSError unless the master's RPC port accepts a connection and (for an HTTP
    metadata service) the metadata server answers an HTTP request within ``timeout_s``.
    A stopped master still accepts TCP connections (the kernel does), so the HTTP answer
    is what proves it is alive."""
    import http.client
    import socket
    from urllib.parse import urlsplit

    host, _, port = config.master_address.rpartition(":")
    socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    url = urlsplit(config.metadata_url)
    if url.scheme == "http" and url.hostname:
        conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout_s)
        try:
            conn.request("GET", (url.path or "/") + "?key=tierkv-probe")
            conn.getresponse().read()  # any status (404 included) means it is alive
        except (http.client.HTTPException, OSError) as e:
            raise OSError(f"metadata server {config.metadata_url} did not answer: {e!r}") from None
        finally:
            conn.close()


class _Down(Exception):
    pass


class RemoteTier:
    """Pages in the cluster-wide store. Thread-safe; no method raises on a remote fault."""

    def __init__(self, config: RemoteConfig, layout: PageLayout,
                 backend_factory: Callable[[RemoteConfig], RemoteBackend] = mooncake_backend,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.layout = layout
        self._factory = backend_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._client: RemoteBackend | None = None
        self._stale: list[RemoteBackend] = []  # clients whose call hung: closed at close()
        self._backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, clock)
        self.up = False
        self.last_fault = ""
        self.faults: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="tierkv-remote")

    # ---- connection state --------------------------------------------------------------
    def name(self, key: bytes) -> str:
        return self.config.key_prefix + key.hex()

    @property
    def available(self) -> bool:
        """Up, or due for a reconnect attempt (so a caller may try)."""
        return self.up or self._backoff.ready()

    def _run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        fut = self._pool.submit(fn, *args)
        return fut.result(timeout=timeout or self.config.op_timeout_s)

    def _fault(self, reason: str, detail: object, client: RemoteBackend | None = None, hung: bool = False) -> None:
        with self._lock:
            self.faults[reason] += 1
            self.last_fault = f"{reason}: {detail}"
            wait = self._backoff.failed()
            if self.up or client is self._client:
                log.warning("remote tier down (%s: %s); retry in %.1f s", reason, detail, wait)
            self.up = False
            if hung and client is not None and client is self._client:
                self._stale.append(client)
                self._client = None

    def _count(self, counter: Counter[str], name: str, n: int = 1, detail: str | None = None) -> None:
        with self._lock:
            counter[name] += n
            if detail is not None:
                self.last_fault = f"{name}: {detail}"

    def _connected(self) -> RemoteBackend:
        """The client when the tier is up; else one reconnect attempt when the backoff has
        passed (setup or probe); raises _Down when there is nothing to use."""
        with self._lock:
            client, up = self._client, self.up
            if not up and not self._backoff.ready():
                raise _Down()
            if not up:
                self._backoff.attempt()  # one attempt at a time
        if up and client is not None:
            return client
        if client is None:
            try:
                client = self._run(self._factory, self.config, timeout=self.config.setup_timeout_s)
            except FutureTimeout:
                self._fault("setup_timeout", f"no answer in {self.config.setup_timeout_s:g} s")
                raise _Down() from None
            except Exception as e:  # noqa: BLE001 - any setup failure degrades, never raises
                self._fault("setup_failed", e)
                raise _Down() from None
        else:
            probe = self._call(client, "probe", client.batch_is_exist, [self.config.key_prefix + "probe"])
            if not probe or probe[0] < 0:
                self._fault("unreachable", f"probe status {probe}", client)
                raise _Down()
        with self._lock:
            if self._client is not None and self._client is not client:
                self._stale.append(self._client)
            self._client, self.up = client, True
            self._backoff.succeeded()
            self.counters["reconnects" if self.counters["connects"] else "connects"] += 1  # held: self._lock
            log.info("remote tier up (master %s)", self.config.master_address)
        return client

    def _call(self, client: RemoteBackend, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self._run(fn, *args)
        except FutureTimeout:
            self._fault("timeout", f"{what} took over {self.config.op_timeout_s:g} s", client, hung=True)
        except Exception as e:  # noqa: BLE001 - a client error degrades the tier, never the request
            self._fault("error", f"{what}: {e!r}", client)
        raise _Down()

    # ---- data path ---------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the remote store holds (batched, ``EXISTS_BATCH`` keys a call);
        False from the first fault on (the tier is then down)."""
        out: list[bool] = []
        for start in range(0, len(keys), EXISTS_BATCH):
            chunk = keys[start : start + EXISTS_BATCH]
            try:
                client = self._connected()
                codes = self._call(client, "batch_is_exist", client.batch_is_exist, [self.name(k) for k in chunk])
            except _Down:
                break
            if len(codes) != len(chunk) or any(c < 0 for c in codes):
                self._fault("unreachable", f"batch_is_exist status {sorted(set(codes))[:3]}", client)
                break
            self._count(self.counters, "exists_calls")
            out.extend(c == 1 for c in codes)
        return out + [False] * (len(keys) - len(out))

    def put_pages(self, keys: Sequence[bytes], pages: torch.Tensor | Sequence[torch.Tensor],
                  metas: Sequence[RemoteMeta]) -> RemotePutResult:
        """Publish pages (``[n, L, 2, B, H, D]``) with their metadata; objects already
        present are skipped (first writer wins: an object is never overwritten in place)."""
        if not keys:
            return RemotePutResult(0, 0, 0)
        present = self.exists(keys)
        if not self.up:
            return RemotePutResult(0, 0, len(keys))
        todo = [i for i, p in enumerate(present) if not p]
        published = failed = 0
        batch: list[int] = []
        size = 0
        budget = max(self.config.local_buffer_bytes // 2, 1)
        for n, i in enumerate(todo):
            batch.append(i)
            size += layout_info(self.layout)[0]
            if size >= budget or n == len(todo) - 1:
                ok = self._put_batch([keys[j] for j in batch], [pages[j] for j in batch], [metas[j] for j in batch])
                published += len(batch) if ok else 0
                failed += 0 if ok else len(batch)
                batch, size = [], 0
        self._count(self.counters, "published", published)
        self._count(self.counters, "publish_failed", failed)
        return RemotePutResult(published, len(keys) - len(todo), failed)

    def _put_batch(self, keys: list[bytes], pages: list[torch.Tensor], metas: list[RemoteMeta]) -> bool:
        blobs = [encode_object(m, self.layout, p) for m, p in zip(metas, pages, strict=True)]
        try:
            client = self._connected()
            rc = self._call(client, "put_batch", client.put_batch, [self.name(k) for k in keys], blobs)
        except _Down:
            return False
        if rc != 0:
            # Full store, or another node won the race for some key: not a connection fault.
            self._count(self.faults, "put_rejected", detail=f"status {rc}")
            return False
        self._count(self.counters, "published_bytes", sum(len(b) for b in blobs))
        return True

    def get_pages(self, keys: Sequence[bytes], expect: Sequence[RemoteMeta | None]) -> list[RemotePage]:
        """Fetch and verify a run of pages; stops at the first one missing or bad. ``expect``
        gives, per key, what the request knows (model version, namespace, parent, tokens;
        checksum ignored): a mismatch is a miss."""
        out: list[RemotePage] = []
        budget = max(self.config.local_buffer_bytes // 2 // layout_info(self.layout)[0], 1)
        for start in range(0, len(keys), budget):
            chunk = list(keys[start : start + budget])
            try:
                client = self._connected()
                blobs = self._call(client, "get_batch", client.get_batch, [self.name(k) for k in chunk])
            except _Down:
                return out
            # A short answer (fewer blobs than keys) ends the run at the first missing one.
            for k, want, blob in zip(chunk, expect[start : start + budget], blobs, strict=False):
                page = self._verified(client, k, want, blob)
                if page is None:
                    return out
                out.append(page)
            if len(blobs) < len(chunk):
                return out
        return out

    def get(self, key: bytes, expect: RemoteMeta | None = None) -> RemotePage | None:
        """One page and its metadata, verified; None on a miss or any fault."""
        pages = self.get_pages([key], [expect])
        return pages[0] if pages else None

    def _verified(self, client: RemoteBackend, key: bytes, want: RemoteMeta | None, blob: bytes) -> RemotePage | None:
        if not blob:
            self._count(self.counters, "misses")  # gone (evicted by the master) since exists()
            return None
        try:
            page = decode_object(blob, self.layout)
            m = page.meta
            if m.key != key:
                raise BadObject("object holds another block's key")
            if want is not None:
                for field in ("model_version", "namespace", "parent", "tokens"):
                    if getattr(m, field) != getattr(want, field):
                        raise BadObject(f"{field} differs from the request's")
        except BadObject as e:
            self._count(self.faults, "verify_failed", detail=str(e))
            log.warning("remote block %s failed verification: %s", key.hex()[:16], e)
            if self.config.remove_corrupt:
                with contextlib.suppress(_Down):
                    self._call(client, "remove", client.remove, self.name(key))
            return None
        self._count(self.counters, "hits")
        self._count(self.counters, "fetched_bytes", len(blob))
        return page

    def remove_pages(self, keys: Sequence[bytes]) -> int:
        """Remove the objects of ``keys`` that the remote store holds (an invalidation);
        returns how many went. One existence check, then one remove per object present.
        Stops at the first fault (the tier is then down): the rest stay. An object the store
        refuses to remove (a reader holds it) stays too, counted under ``remove_refused``."""
        present = [k for k, p in zip(keys, self.exists(keys)) if p]
        removed = 0
        for k in present:
            try:
                client = self._connected()
                rc = self._call(client, "remove", client.remove, self.name(k))
            except _Down:
                break
            if rc == 0:
                removed += 1
            else:
                self._count(self.faults, "remove_refused", detail=f"status {rc}")
        self._count(self.counters, "removed", removed)
        return removed

    # ---- operations --------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "up": self.up, "master": self.config.master_address, "key_prefix": self.config.key_prefix,
                "last_fault": self.last_fault, "faults": dict(self.faults), **dict(self.counters),
            }

    def check_integrity(self) -> None:
        with self._lock:
            assert not (self.up and self._client is None), "remote tier up without a client"
            assert all(v >= 0 for v in (*self.faults.values(), *self.counters.values())), "negative counter"
            self._backoff.check_integrity()

    def close(self) -> None:
        with self._lock:
            clients = [c for c in (self._client, *self._stale) if c is not None]
            self._client, self._stale, self.up = None, [], False
        # Closing unmounts this node's segment from the master: about 3 s with Mooncake
        # 0.3.13 on loopback, so clients close side by side, bounded by setup_timeout_s.
        futures = [self._pool.submit(c.close) for c in clients]
        deadline = time.monotonic() + self.config.setup_timeout_s
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                log.warning("closing a remote client failed: %r", e)
        self._pool.shutdown(wait=False, cancel_futures=True)
