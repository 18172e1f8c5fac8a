"""Loading a local Hugging Face causal LM and deriving what the store needs from it.

A model directory gives three things to tierkv: the page layout of its KV (layers, KV
heads, head dim, dtype), its model version (a content hash, :mod:`tierkv.model_version`)
and a tokenizer. Nothing is ever downloaded: every load passes ``local_files_only``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..errors import ConfigError, InvalidTokensError
from ..identity import Scope
from ..layout import DTYPES, PageLayout
from ..model_version import model_version
from .cache_support import probe_cache
from .config import (  # noqa: F401 (re-exported: callers import them from here too)
    DEFAULT_BLOCK_SIZE, DTYPE_CHOICES, check_config, check_model_dir, context_length, layout_from_config,
    layout_from_model, load_config, resolve_dtype,
)

if TYPE_CHECKING:
    from ..api import StoreAPI

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model, its tokenizer and the identity its KV is stored under."""

    model: Any
    tokenizer: Any
    layout: PageLayout
    model_version: str
    model_dir: Path
    context_length: int | None
    embedding_rows: int | None = None  # token ids the model can embed (None: not checked)

    def scope(self, namespace: str = "default") -> Scope:
        return Scope(model_version=self.model_version, namespace=namespace)

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list; InvalidTokensError naming the first token the model cannot
        embed (a tokenizer with more entries than the embedding, e.g. an added pad token)."""
        out = [int(i) for i in ids]
        rows = self.embedding_rows
        if rows is not None:
            for i in out:
                if not 0 <= i < rows:
                    token = self.tokenizer.convert_ids_to_tokens(i) if self.tokenizer is not None else None
                    raise InvalidTokensError(
                        f"token {token!r} (id {i}) is outside the model's embedding of {rows} rows",
                        hint="remove that token from the input, or resize the model's embedding to the tokenizer",
                    )
        return out

    def encode_document(self, text: str) -> list[int]:
        """Token ids of a prefix document: special tokens (e.g. BOS) included, as a
        request that starts with this document would be tokenized."""
        return self.check_ids(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of text that follows a prefix: tokenized on its own, no special tokens."""
        return self.check_ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def prefill(self, tokens: Sequence[int], store: "StoreAPI | None" = None, namespace: str = "default", **kwargs: Any) -> Any:
        """:func:`tierkv.hf.cached_prefill` of this model under its own scope."""
        from .prefill import cached_prefill

        scope = self.scope(namespace) if store is not None else None
        return cached_prefill(self.model, tokens, store=store, scope=scope, **kwargs)

    def generate(self, tokens: Sequence[int], store: "StoreAPI | None" = None, namespace: str = "default", **kwargs: Any) -> Any:
        """:func:`tierkv.hf.generate` with this model under its own scope."""
        from .generate import generate

        scope = self.scope(namespace) if store is not None else None
        return generate(self.model, tokens, store=store, scope=scope, **kwargs)


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

    Raises NotFoundError for a missing or non-model directory, ConfigError when the weights
    or tokenizer cannot be loaded, and UnsupportedModelError (a ConfigError) for a model
    whose cache tierkv cannot store. A tokenizer with more entries than the model's
    embedding is a logged warning; encoding one of the extra tokens raises
    InvalidTokensError (:meth:`LoadedModel.check_ids`).
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
        # Common after fine-tuning (an added pad token): text that never produces the extra
        # ids runs fine, so this is a warning; encoding one of them is the error.
        log.warning("the tokenizer in %s has %d tokens but the model embeds only %d; text containing the "
                    "extra tokens will be refused", root, len(tokenizer), embedding_rows)
    layout = layout_from_model(model, block_size)
    probe_cache(model, layout)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        layout=layout,
        model_version=model_version(root, layout, memo_path=memo_path),
        model_dir=root,
        context_length=context_length(config),
        embedding_rows=embedding_rows,
    )
