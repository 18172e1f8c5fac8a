"""Which transformers models tierkv can store the KV of, and the refusal of the others.

A stored block must give, on a hit, the logits a recomputation gives. That holds when every
layer keeps plain per-token K/V ``[batch, kv_heads, seq, head_dim]`` that is a pure function
of the prefix, which is true of two kinds of attention layer:

- ``full_attention``: the classic case.
- ``sliding_attention`` (Mistral, Qwen2/3 with ``use_sliding_window``, Gemma-2/3, Cohere2,
  GPT-OSS, ...): the KV of a token does not depend on the window; only the *mask* does.
  transformers' own cache for such a layer drops keys older than the window, so a later
  request could not restore them; tierkv builds a plain ``DynamicCache()`` without the
  config (see :mod:`tierkv.hf.prefill`), which keeps every key, and the model's sliding mask
  then reads only the window. Tests compare logits with recomputation past the window.

Everything else is refused when the model is loaded (:func:`~tierkv.hf.config.check_config`
on the config, :func:`probe_cache` on the loaded model), with :class:`UnsupportedModelError` naming the
reason: recurrent or linear-attention state (Mamba, GDN, RecurrentGemma, conv layers: not
per-token KV), chunked or indexed/compressed sparse attention (untested mask or cache
semantics), KV shared across layers (Gemma-3n: fewer cache layers than model layers) and
multi-head latent attention (K and V of different widths). The probe catches what the config
does not say: a model that replaces the cache, keeps other layer classes, or other shapes.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..layout import PageLayout
from .config import SUPPORTED_LAYER_TYPES, attention_kinds, check_config, model_type  # noqa: F401 (the config half)

@torch.inference_mode()
def probe_cache(model: Any, layout: PageLayout) -> None:
    """Run ``model`` on two tokens with a fresh, config-less ``DynamicCache`` and raise
    UnsupportedModelError unless the model fills exactly that cache with one plain
    ``DynamicLayer`` per layer of ``layout``, each K and V ``[1, kv_heads, 2, head_dim]`` in
    the layout's dtype. Costs one forward pass of two tokens."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    name = model_type(model.config)
    cache = DynamicCache()
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    try:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, NotImplementedError, RuntimeError) as exc:
        raise UnsupportedModelError(f"model type {name!r} does not run with a plain DynamicCache: {exc}") from exc
    if out.past_key_values is not cache:
        raise UnsupportedModelError(
            f"model type {name!r} replaced the DynamicCache it was given with a {type(out.past_key_values).__name__}")
    if len(cache.layers) != layout.num_layers:
        raise UnsupportedModelError(
            f"model type {name!r} keeps KV for {len(cache.layers)} layers, its config says {layout.num_layers}")
    want = (1, layout.num_kv_heads, 2, layout.head_dim)
    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise UnsupportedModelError(f"model type {name!r} keeps layer {index} in a {type(layer).__name__}")
        for part, tensor in (("K", layer.keys), ("V", layer.values)):
            if tuple(tensor.shape) != want or tensor.dtype != layout.torch_dtype:
                raise UnsupportedModelError(
                    f"model type {name!r} keeps {part} of layer {index} as {tuple(tensor.shape)} {tensor.dtype}; "
                    f"the page layout needs {want} {layout.torch_dtype}")
