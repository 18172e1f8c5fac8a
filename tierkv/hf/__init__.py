"""transformers integration: layout and model version of a local model, cached prefill,
generation. See :mod:`tierkv.hf.prefill` for how a stored prefix becomes a DynamicCache."""
from __future__ import annotations

from .generate import GREEDY, GenerationResult, SamplingConfig, generate
from .model import (
    DEFAULT_BLOCK_SIZE,
    DTYPE_CHOICES,
    LoadedModel,
    check_model_dir,
    context_length,
    layout_from_config,
    layout_from_model,
    load_config,
    load_model,
    resolve_dtype,
    version_of,
)
from .prefill import (
    DEFAULT_CHUNK_TOKENS,
    PrefillResult,
    Restored,
    cache_from_kv,
    cache_layer_kv,
    cached_prefill,
    empty_cache,
    lease_kv,
    restore_cache,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CHUNK_TOKENS",
    "DTYPE_CHOICES",
    "GREEDY",
    "GenerationResult",
    "LoadedModel",
    "PrefillResult",
    "Restored",
    "SamplingConfig",
    "cache_from_kv",
    "cache_layer_kv",
    "cached_prefill",
    "check_model_dir",
    "context_length",
    "empty_cache",
    "generate",
    "layout_from_config",
    "layout_from_model",
    "lease_kv",
    "load_config",
    "load_model",
    "resolve_dtype",
    "restore_cache",
    "version_of",
]
