"""The worker side of the vLLM connector: load planned pages into vLLM's KV blocks before
the forward pass, save newly computed full blocks after it.

Loads are synchronous (vLLM calls ``start_load_kv`` before the forward when a step has
sync loads) and verified by tierkv: a page read from disk is checksummed, and a block that
cannot be leased - evicted since the lookup, corrupt, or the daemon gone - is reported to
vLLM as a failed block, so vLLM recomputes from the first failed block instead of reading
garbage. Blocks after a failed one are reported too: a prefix is only usable up to its
first hole. The reads themselves usually started earlier: the scheduler side asks tierkv to
prefetch a request's pages when it promises them (``update_state_after_alloc``), so by the
time the worker leases them they are in tierkv's device tier, and the worker copies them
from the leased pool slots straight into vLLM's blocks.

Saves run in ``wait_for_save`` after the forward, but only the copy out of vLLM's blocks
happens there (so vLLM may free or reuse the blocks as soon as the call returns); the
durable put runs on the :class:`~.saver.SaveQueue` writer thread, and a save that does
not fit in the bounded queue is dropped and counted instead of stalling the engine.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch

from ...layout import PageLayout
from .pages import PagedKV, UnsupportedCacheError, backend_kv_split, layer_kv_scales
from .saver import PendingSave, SaveQueue
from .scheduler import LoadSpec, SaveSpec, TierKVConnectorMetadata
from .stats import Counters
from .store import StoreHandle

log = logging.getLogger(__name__)
DEFAULT_SAVE_QUEUE_BYTES = 256 << 20  # pages copied out of vLLM and not yet written


class WorkerSide:
    """Moves pages between tierkv and vLLM's KV caches for the steps' plans."""

    def __init__(self, handle: StoreHandle, layout: PageLayout, enabled: bool,
                 save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES, unit_scales: bool = False) -> None:
        self.handle = handle
        self.layout = layout
        self.enabled = enabled
        # An fp8 cache whose model version says its scales are 1.0 (no quantization config):
        # checked against the layers at register, since pages quantised with other scales
        # would load as other KV under the same key.
        self.unit_scales = unit_scales
        self.paged: PagedKV | None = None
        self.counters = Counters()
        self._failed_blocks: set[int] = set()
        self.saves = SaveQueue(self._write, save_queue_bytes)

    def register(self, vllm_config: Any, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Map vLLM's per-layer caches; an unsupported shape disables the connector."""
        if not self.enabled:
            return
        try:
            split = backend_kv_split(vllm_config, list(kv_caches), next(iter(kv_caches.values())).dtype)
            if self.unit_scales:
                check_unit_scales(layer_kv_scales(vllm_config, list(kv_caches)))
            self.paged = PagedKV(kv_caches, self.layout, num_blocks, split)
        except UnsupportedCacheError as e:
            log.warning("TierKVConnector disabled: %s", e)
            self.enabled = False

    # ---- loads ----------------------------------------------------------------------------
    def load(self, meta: TierKVConnectorMetadata) -> None:
        for spec in meta.loads:
            self._load_one(spec)

    def _load_one(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        loaded = 0
        try:
            if self.paged is not None:
                loaded = self._copy_in(spec)
        except Exception as e:  # never let a cache problem fail the step
            log.warning("tierkv load for %s failed, vLLM recomputes: %s: %s", spec.req_id, type(e).__name__, e)
            loaded = 0
        failed = spec.block_ids[loaded:]
        self._failed_blocks.update(failed)
        self.counters.add(loads=1, loaded_tokens=loaded * self.layout.block_size, load_failed_blocks=len(failed),
                          load_seconds=time.perf_counter() - t0)

    def _copy_in(self, spec: LoadSpec) -> int:
        """Copy leased pages into the request's blocks; returns how many of ``spec.block_ids``
        (from the first) now hold verified KV."""
        assert self.paged is not None
        # Only the blocks to fill: those before first_block vLLM already holds, so promoting
        # them into tierkv's device tier would be wasted reads.
        lease = self.handle.acquire(list(spec.token_ids), spec.scope, len(spec.block_ids), spec.first_block)
        if lease is None:
            return 0
        with _released(lease):
            got = min(lease.num_blocks, len(spec.block_ids))
            if got > 0:
                # Straight from the leased slots into vLLM's blocks: no intermediate stack.
                self.paged.copy_in(lease.pool, lease.slots[:got], spec.block_ids[:got])
            return max(got, 0)

    def take_failed_blocks(self) -> set[int]:
        """vLLM block ids whose promised KV was not loaded since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- saves ----------------------------------------------------------------------------
    def save(self, meta: TierKVConnectorMetadata) -> None:
        """Copy each planned save out of vLLM's blocks and queue it (returns without writing)."""
        if self.paged is None:
            return
        for spec in meta.saves:
            self._save_one(spec)

    def _save_one(self, spec: SaveSpec) -> None:
        assert self.paged is not None
        try:
            pages = self.paged.gather(spec.block_ids)
        except Exception as e:
            log.warning("tierkv save for %s skipped: %s: %s", spec.req_id, type(e).__name__, e)
            self.counters.add(save_failures=1)
            return
        pending = PendingSave(spec.req_id, spec.token_ids, spec.scope, spec.first_block, pages)
        if not self.saves.submit(pending):
            self.counters.add(save_dropped_blocks=len(spec.block_ids))

    def _write(self, save: PendingSave) -> bool:
        # On the writer thread.
        ok = self.handle.put(list(save.token_ids), save.pages, save.scope, save.first_block)
        if ok:
            self.counters.add(saved_tokens=save.pages.shape[0] * self.layout.block_size)
        else:
            self.counters.add(save_failures=1)
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued saves are written (stats and tests read settled counters)."""
        return self.saves.flush(timeout)

    def close(self) -> None:
        self.saves.close()  # its writes read pages already copied out: the helper may stop
        if self.paged is not None:
            self.paged.close()


def check_unit_scales(scales: Mapping[str, tuple[float, float]]) -> None:
    """Raise UnsupportedCacheError unless every layer's fp8 ``k_scale`` and ``v_scale`` is 1.0."""
    other = {name: kv for name, kv in scales.items() if kv != (1.0, 1.0)}
    if other:
        name, (k, v) = sorted(other.items())[0]
        raise UnsupportedCacheError(
            f"fp8 KV scales of {len(other)} layers are not 1.0 (e.g. {name}: k_scale={k}, v_scale={v}) although "
            "the model has no quantization config; pages would not identify them")


@contextmanager
def _released(lease: Any) -> Iterator[Any]:
    """``with`` for a lease whose release may fail: a dead daemon cannot take the lease back
    (it expires there), and that must not fail vLLM's step."""
    try:
        yield lease
    finally:
        try:
            lease.release()
        except Exception as e:
            log.debug("tierkv lease release failed: %s", e)
