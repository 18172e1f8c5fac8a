"""Loading a local Hugging Face causal LM and deriving what the store needs from it.

A model directory gives three things to tierkv: the page layout of its KV (layers, KV
heads, head dim, dtype), its model version (a content hash, :mod:`tierkv.model_version`)
and a tokenizer. Nothing is ever downloaded: every load passes ``local_files_only``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ConfigError, NotFoundError
from ..identity import Scope
from ..layout import DTYPES, PageLayout, dtype_name
from ..model_version import model_version
from .cache_support import check_config, probe_cache

DEFAULT_BLOCK_SIZE = 16
DTYPE_CHOICES = ("auto", *DTYPES)


def _text_config(config: Any) -> Any:
    # Multimodal configs nest the language model's config; plain LMs return themselves.
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def resolve_dtype(config: Any, dtype: str = "auto") -> str:
    """The KV dtype name a model will run in: ``dtype`` unless it is ``"auto"``, then the
    dtype recorded in the config when tierkv supports it, else float32."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}", hint=f"use one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    recorded = getattr(config, "dtype", None) or getattr(_text_config(config), "dtype", None)
    if isinstance(recorded, torch.dtype):
        recorded = str(recorded).removeprefix("torch.")
    return recorded if recorded in DTYPES else "float32"


def layout_from_config(config: Any, dtype: str, block_size: int = DEFAULT_BLOCK_SIZE) -> PageLayout:
    """Page layout of a transformers config: layers, KV heads (GQA aware) and head dim
    (``config.head_dim`` when set, else ``hidden_size // num_attention_heads``).

    Raises UnsupportedModelError for a model whose cache tierkv cannot store exactly
    (:mod:`tierkv.hf.cache_support`)."""
    check_config(config)
    cfg = _text_config(config)
    heads = int(cfg.num_attention_heads)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return PageLayout(
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        block_size=block_size,
        dtype=dtype,
    )


def layout_from_model(model: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> PageLayout:
    """Page layout of an instantiated model (its config and parameter dtype)."""
    return layout_from_config(model.config, dtype_name(model.dtype), block_size)


def context_length(config: Any) -> int | None:
    """Longest sequence the model accepts (``max_position_embeddings``), if the config says."""
    value = getattr(_text_config(config), "max_position_embeddings", None)
    return int(value) if value else None


@dataclass(frozen=True)
class LoadedModel:
    """A model, its tokenizer and the identity its KV is stored under."""

    model: Any
    tokenizer: Any
    layout: PageLayout
    model_version: str
    model_dir: Path
    context_length: int | None

    def scope(self, namespace: str = "default") -> Scope:
        return Scope(model_version=self.model_version, namespace=namespace)

    def encode_document(self, text: str) -> list[int]:
        """Token ids of a prefix document: special tokens (e.g. BOS) included, as a
        request that starts with this document would be tokenized."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of text that follows a prefix: tokenized on its own, no special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def prefill(self, tokens: Sequence[int], store: Any = None, namespace: str = "default", **kwargs: Any) -> Any:
        """:func:`tierkv.hf.cached_prefill` of this model under its own scope."""
        from .prefill import cached_prefill

        scope = self.scope(namespace) if store is not None else None
        return cached_prefill(self.model, tokens, store=store, scope=scope, **kwargs)

    def generate(self, tokens: Sequence[int], store: Any = None, namespace: str = "default", **kwargs: Any) -> Any:
        """:func:`tierkv.hf.generate` with this model under its own scope."""
        from .generate import generate

        scope = self.scope(namespace) if store is not None else None
        return generate(self.model, tokens, store=store, scope=scope, **kwargs)


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
    from transformers import AutoConfig

    root = check_model_dir(model_dir)
    try:
        return AutoConfig.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the config in {root}: {exc}", hint="check config.json") from exc


def version_of(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    memo_path: Path | None = None,
) -> tuple[PageLayout, str]:
    """Layout and model version of a model directory without loading its weights."""
    config = load_config(model_dir)
    layout = layout_from_config(config, resolve_dtype(config, dtype), block_size)
    return layout, model_version(model_dir, layout, memo_path=memo_path)


def load_model(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    block_size: int = DEFAULT_BLOCK_SIZE,
    attn_implementation: str = "sdpa",
    memo_path: Path | None = None,
) -> LoadedModel:
    """Load model and tokenizer from a local directory, in eval mode.

    Raises NotFoundError for a missing or non-model directory and ConfigError when the
    weights or tokenizer cannot be loaded or do not fit together (a tokenizer whose
    vocabulary is larger than the model's embedding would index past it), and
    UnsupportedModelError (a ConfigError) for a model whose cache tierkv cannot store.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config(model_dir)
    check_config(config)  # before the weights load: refusing a large model should be quick
    root = Path(model_dir)
    kv_dtype = resolve_dtype(config, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {root}: {exc}", hint="save the tokenizer into the model directory") from exc
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            root,
            dtype=DTYPES[kv_dtype],
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"cannot load a causal LM from {root}: {exc}", hint="check the weight files and config.json") from exc
    model.to(device).eval()
    embedding_rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedding_rows:
        raise ConfigError(
            f"the tokenizer in {root} has {len(tokenizer)} tokens but the model embeds only {embedding_rows}",
            hint="the tokenizer does not belong to this model; save the matching tokenizer into the directory",
        )
    layout = layout_from_model(model, block_size)
    probe_cache(model, layout)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        layout=layout,
        model_version=model_version(root, layout, memo_path=memo_path),
        model_dir=root,
        context_length=context_length(config),
    )
