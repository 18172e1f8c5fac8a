"""The worker side of the vLLM connector: load planned pages into vLLM's KV blocks before
the forward pass, save newly computed full blocks after it.

Loads are synchronous (vLLM calls ``start_load_kv`` before the forward when a step has
sync loads) and verified by tierkv: a page read from disk is checksummed, and a block that
cannot be leased - evicted since the lookup, corrupt, or the daemon gone - is reported to
vLLM as a failed block, so vLLM recomputes from the first failed block instead of reading
garbage. Blocks after a failed one are reported too: a prefix is only usable up to its
first hole.

Saves run in ``wait_for_save`` after the forward: the pages are gathered (copied) out of
vLLM's blocks and put synchronously, so vLLM may free or reuse the blocks as soon as the
call returns (``request_finished`` never has to delay a free).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import torch

from ..layout import PageLayout
from .vllm_pages import PagedKV, UnsupportedCacheError, backend_kv_split
from .vllm_scheduler import LoadSpec, SaveSpec, TierKVConnectorMetadata
from .vllm_stats import Counters
from .vllm_store import StoreHandle

log = logging.getLogger(__name__)


class WorkerSide:
    """Moves pages between tierkv and vLLM's KV caches for the steps' plans."""

    def __init__(self, handle: StoreHandle, layout: PageLayout, enabled: bool) -> None:
        self.handle = handle
        self.layout = layout
        self.enabled = enabled
        self.paged: PagedKV | None = None
        self.counters = Counters()
        self._failed_blocks: set[int] = set()

    def register(self, vllm_config: Any, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Map vLLM's per-layer caches; an unsupported shape disables the connector."""
        if not self.enabled:
            return
        try:
            split = backend_kv_split(vllm_config, list(kv_caches))
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
        try:
            got = min(lease.num_blocks, len(spec.block_ids))
            if got <= 0:
                return 0
            pages = torch.stack([lease.page(i) for i in range(got)])
            self.paged.scatter(pages, spec.block_ids[:got])
            return got
        finally:
            try:
                lease.release()
            except Exception as e:  # a dead daemon cannot take the lease back; it expires there
                log.debug("tierkv lease release failed: %s", e)

    def take_failed_blocks(self) -> set[int]:
        """vLLM block ids whose promised KV was not loaded since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- saves ----------------------------------------------------------------------------
    def save(self, meta: TierKVConnectorMetadata) -> None:
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
        if self.handle.put(list(spec.token_ids), pages, spec.scope, spec.first_block):
            self.counters.add(saved_tokens=len(spec.block_ids) * self.layout.block_size)
        else:
            self.counters.add(save_failures=1)
