"""tierkv as a vLLM KV connector (built against vLLM 0.32.0).

    vllm serve MODEL_DIR --block-size 32 --kv-transfer-config '{"kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/tierkv.sock"}}'

vLLM makes one connector object per role: the scheduler's answers how many prompt tokens
tierkv can supply and plans loads and saves (:mod:`.scheduler`); each worker's moves
pages between tierkv and its KV caches (:mod:`.worker`). Blocks are keyed by tierkv's
own chained keys, rooted in the model version of the served weights (:mod:`.config`),
so a store is shared safely across engines, restarts and models.

Failure policy: whatever goes wrong in tierkv - a miss, an error, a timeout, a dead daemon,
a page that fails its checksum, a cache layout this module does not know - vLLM
recomputes; no request fails and no unverified KV is loaded. A failed load is reported
through ``get_block_ids_with_load_errors``, which vLLM turns into a recompute when
``kv_load_failure_policy`` is ``"recompute"``; this connector sets that policy itself when
it is left at vLLM's default (``"fail"``), because the default would fail the request.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...layout import PageLayout
from .config import (VLLM_VERSION, ConnectorConfig, UnsupportedModelError, kv_format, layout_from_vllm,
                     served_model_version)
from .scheduler import SchedulerSide, TierKVConnectorMetadata
from .stats import STAT_KEYS, TierKVConnectorStats, interval_stats
from .store import StoreHandle
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
STATS_FLUSH_S = 30.0  # stats() waits this long for queued saves to be written
_HIT_SOURCE = {"device": CacheHitSource.DEVICE, "host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}

__all__ = ["TierKVConnector", "TierKVConnectorMetadata", "TierKVConnectorStats", "VLLM_VERSION"]


def _identity(vllm_config: "VllmConfig", cfg: ConnectorConfig, kv_cache_config: "KVCacheConfig | None") -> tuple[PageLayout | None, str | None]:
    """The page layout and model version, or (layout-or-None, None) when the connector must
    stay out of the way for this model."""
    try:
        layout = layout_from_vllm(vllm_config)
    except UnsupportedModelError as e:
        log.warning("TierKVConnector disabled: %s", e)
        return None, None
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            log.warning("TierKVConnector disabled: only models with one full-attention KV cache group are supported")
            return layout, None
    try:
        return layout, served_model_version(vllm_config, layout, cfg.model_version)
    except Exception as e:
        log.warning("TierKVConnector disabled: cannot compute the model version: %s", e)
        return layout, None


class TierKVConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a tierkv store (embedded ``home``) or daemon (``socket``)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save lost to preemption is a later miss, nothing more

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy != "recompute":
            # vLLM's default ("fail") would fail a request whose load tierkv could not serve
            # (an evicted or corrupt page); the scheduler reads the policy after building us.
            log.warning("TierKVConnector sets kv_load_failure_policy='recompute' (was %r)", ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = "recompute"
        layout, mv = _identity(vllm_config, self.config, kv_cache_config)
        self.layout = layout
        self.model_version = mv
        enabled = layout is not None and mv is not None
        # A disabled connector still needs a layout for its (idle) helpers.
        layout = layout or PageLayout(1, 1, 1)
        self.handle = StoreHandle(self.config, layout)
        if enabled:
            # Now, at engine start: opening lazily made the first request pay for it.
            self.handle.open()
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.handle, layout, mv if enabled else None, self.config.save)
        else:
            unit_scales = enabled and kv_format(vllm_config).unit_scales
            self.worker = WorkerSide(self.handle, layout, enabled, self.config.save_queue_bytes, unit_scales)
        self._reported: dict[str, Any] = {k: 0 for k in STAT_KEYS}
        log.info("TierKVConnector (%s) for vLLM %s: %s, model version %s, layout %s", role.name, VLLM_VERSION,
                 f"home {self.config.home}" if self.config.home else f"socket {self.config.socket}",
                 (mv or "-")[:16], layout.to_json() if enabled else "disabled")

    # ---- scheduler side ---------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            return self.scheduler.matched(request, num_computed_tokens), False
        except Exception as e:  # a bug here must cost a cache hit, not the request
            log.warning("TierKVConnector lookup error, treating as a miss: %s: %s", type(e).__name__, e)
            return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        # Not wrapped like the lookup: once tokens are promised, losing their load plan would
        # leave vLLM reading unfilled blocks. An error here stays loud instead.
        assert self.scheduler is not None
        block_ids = blocks.get_block_ids()
        self.scheduler.allocated(request, list(block_ids[0]) if block_ids else [], num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Split a hit by the tierkv tier each block was found in (on a CPU-only store the
        "device" tier is host memory)."""
        assert self.scheduler is not None
        by_tier = self.scheduler.hit_sources(request.request_id, num_external_tokens)
        if sum(by_tier.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {_HIT_SOURCE[t]: n for t, n in by_tier.items()}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request)
        return False, None  # saves copy the pages in wait_for_save: vLLM may free the blocks now

    # ---- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(self._vllm_config, kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, TierKVConnectorMetadata):
            self.worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole pages (all layers) are saved in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, TierKVConnectorMetadata):
            self.worker.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> TierKVConnectorStats | None:
        if self.worker is None:
            return None
        now = self.worker.counters.snapshot()
        stats = interval_stats(now, self._reported)
        self._reported = now
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVConnectorStats | None:
        return TierKVConnectorStats(data=dict(data)) if data is not None else TierKVConnectorStats()

    # ---- both -------------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """Cumulative counters of this side (hits on the scheduler side; loaded and saved
        tokens and load latency on the worker side) and the store's own statistics. On the
        worker side it first waits (up to :data:`STATS_FLUSH_S`) for queued saves."""
        if self.worker is not None:
            self.worker.flush(STATS_FLUSH_S)  # report saves as written, not as queued
        side = self.scheduler or self.worker
        counters = side.counters.snapshot() if side is not None else {}
        enabled = self.model_version is not None and (self.worker is None or self.worker.enabled)
        paged = self.worker.paged if self.worker is not None else None
        return {"role": self.role.name, "enabled": enabled,
                "kv_split": paged.kv_split if paged is not None else None,  # how K and V sit in vLLM's tiles
                "model_version": self.model_version, "layout": self.layout.to_dict() if self.layout else None,
                "store_errors": self.handle.errors,
                **counters, "store": self.handle.stats()}

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()  # writes the queued saves first
        self.handle.close()
