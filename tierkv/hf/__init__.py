"""transformers integration: layout and model version of a local model, which caches can be
stored, cached prefill, generation, multi-turn chat. See :mod:`tierkv.hf.prefill` for how a
stored prefix becomes a DynamicCache."""
from __future__ import annotations

from .cache_support import probe_cache
from .chat import ChatTurn, Conversation
from .generate import GREEDY, GenerationResult, SamplingConfig, generate
from .config import (
    DEFAULT_BLOCK_SIZE,
    DTYPE_CHOICES,
    attention_kinds,
    check_config,
    check_model_dir,
    context_length,
    layout_from_config,
    layout_from_model,
    load_config,
    resolve_dtype,
    text_config,
)
from .model import LoadedModel, load_model, version_of
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
    "ChatTurn",
    "Conversation",
    "DTYPE_CHOICES",
    "GREEDY",
    "GenerationResult",
    "LoadedModel",
    "PrefillResult",
    "Restored",
    "SamplingConfig",
    "attention_kinds",
    "cache_from_kv",
    "cache_layer_kv",
    "cached_prefill",
    "check_config",
    "check_model_dir",
    "context_length",
    "empty_cache",
    "generate",
    "layout_from_config",
    "layout_from_model",
    "lease_kv",
    "load_config",
    "load_model",
    "probe_cache",
    "resolve_dtype",
    "restore_cache",
    "text_config",
    "version_of",
]
