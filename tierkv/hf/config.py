"""What tierkv reads from a transformers config: the text config of a multimodal model,
the KV dtype, the page layout, the context length, and whether the cache can be stored.

A leaf of :mod:`tierkv.hf` (it imports no other module of the package), so that model
loading (:mod:`~tierkv.hf.model`), prefill, generation and batching all take these from one
place without importing each other. Nothing here loads weights.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, NotFoundError, UnsupportedModelError
from ..layout import DTYPES, PageLayout, dtype_name

DEFAULT_BLOCK_SIZE = 16
DTYPE_CHOICES = ("auto", *DTYPES)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

# Config attributes of model families whose cache is not plain per-layer K/V, with the reason
# (see tierkv.hf.cache_support for the whole rule).
_REFUSED_ATTRIBUTES = (
    ("num_kv_shared_layers", "shares KV between layers (num_kv_shared_layers), so its cache has fewer layers than the model"),
    ("kv_lora_rank", "uses multi-head latent attention (kv_lora_rank): K and V have different widths"),
    ("attention_chunk_size", "uses chunked attention (attention_chunk_size), which tierkv does not test"),
    ("block_types", "has recurrent blocks (block_types), whose state is not per-token KV"),
)


def text_config(config: Any) -> Any:
    """The language model's config: multimodal configs nest it; plain LMs return themselves."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def model_type(config: Any) -> str:
    cfg = text_config(config)
    return str(getattr(cfg, "model_type", None) or type(cfg).__name__)


def attention_kinds(config: Any) -> tuple[str, ...]:
    """The distinct layer types of a config, in order of first appearance; a config without
    ``layer_types`` is ``("full_attention",)`` or, with an active ``sliding_window``,
    ``("sliding_attention",)`` (Mistral)."""
    cfg = text_config(config)
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(dict.fromkeys(str(t) for t in types))
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return ("sliding_attention",)
    return ("full_attention",)


def check_config(config: Any) -> None:
    """Raise UnsupportedModelError unless every layer of ``config`` is full or sliding-window
    attention with plain per-layer K/V (see :mod:`tierkv.hf.cache_support`)."""
    cfg = text_config(config)
    name = model_type(cfg)
    others = [t for t in attention_kinds(cfg) if t not in SUPPORTED_LAYER_TYPES]
    if others:
        raise UnsupportedModelError(
            f"model type {name!r} has layers of type {', '.join(others)}; tierkv stores only "
            f"{' and '.join(SUPPORTED_LAYER_TYPES)} KV"
        )
    for attribute, reason in _REFUSED_ATTRIBUTES:
        value = getattr(cfg, attribute, None)
        if value not in (None, 0, False, [], ()):
            raise UnsupportedModelError(f"model type {name!r} {reason}")


def resolve_dtype(config: Any, dtype: str = "auto") -> str:
    """The KV dtype name a model will run in: ``dtype`` unless it is ``"auto"``, then the
    dtype recorded in the config when tierkv supports it, else float32."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}", hint=f"use one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    recorded = getattr(config, "dtype", None) or getattr(text_config(config), "dtype", None)
    if isinstance(recorded, torch.dtype):
        recorded = str(recorded).removeprefix("torch.")
    return recorded if recorded in DTYPES else "float32"


def layout_from_config(config: Any, dtype: str, block_size: int = DEFAULT_BLOCK_SIZE) -> PageLayout:
    """Page layout of a transformers config: layers, KV heads (GQA aware) and head dim
    (``config.head_dim`` when set, else ``hidden_size // num_attention_heads``).

    Raises UnsupportedModelError for a model whose cache tierkv cannot store exactly."""
    check_config(config)
    cfg = text_config(config)
    heads = int(cfg.num_attention_heads)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return PageLayout(num_layers=int(cfg.num_hidden_layers), num_kv_heads=int(kv_heads), head_dim=int(head_dim),
                      block_size=block_size, dtype=dtype)


def layout_from_model(model: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> PageLayout:
    """Page layout of an instantiated model (its config and parameter dtype)."""
    return layout_from_config(model.config, dtype_name(model.dtype), block_size)


def context_length(config: Any) -> int | None:
    """Longest sequence the model accepts (``max_position_embeddings``), if the config says."""
    value = getattr(text_config(config), "max_position_embeddings", None)
    return int(value) if value else None


def check_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """Raise NotFoundError unless ``model_dir`` is a directory with a config.json."""
    root = Path(model_dir)
    if not root.exists():
        raise NotFoundError(f"model directory {root} does not exist", hint="pass --model DIR of a local Hugging Face model")
    if not root.is_dir() or not (root / "config.json").is_file():
        raise NotFoundError(
            f"{root} is not a model directory (no config.json)",
            hint="pass a directory saved with save_pretrained(): config.json, weights and tokenizer files",
        )
    return root


def load_config(model_dir: str | os.PathLike[str]) -> Any:
    """The config of a local model directory (never downloads). ConfigError when unreadable."""
    from transformers import AutoConfig

    root = check_model_dir(model_dir)
    try:
        return AutoConfig.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the config in {root}: {exc}", hint="check config.json") from exc
