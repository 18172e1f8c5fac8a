"""Token generation on top of :func:`cached_prefill`: greedy, or sampling with a seed.

Time to first token (``ttft_s``) runs from the call until the first new token is chosen,
so it includes the store lookup, the restore and the suffix prefill, and excludes
tokenization (callers tokenize before calling).

Multi-turn: the blocks completed by the generated tokens are stored too (``store_output``),
so the next turn of a conversation, whose prompt repeats this answer, restores through it.
Their KV was computed one token at a time during decode, not by a prefill; the two differ
by float rounding only (the same math on other matmul shapes: ~1e-7 relative in fp32), and
tests/test_hf_multiturn.py checks that a hit through such blocks gives the logits of a full
recomputation within the fp32 tolerance of every hit (1e-5). The token chosen last has no
KV yet (it was never fed to the model), so it and any partial block stay unstored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..errors import ConfigError
from ..identity import Scope
from ..layout import pack_pages
from .config import context_length
from .prefill import DEFAULT_CHUNK_TOKENS, Progress, cache_layer_kv, cached_prefill, put_what_fits

if TYPE_CHECKING:
    from ..api import StoreAPI


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy decoding; otherwise softmax sampling at that
    temperature, over the ``top_k`` most likely tokens when set, from a generator seeded
    with ``seed`` (so a seeded run is reproducible on one device)."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k must be positive, got {self.top_k}")


GREEDY = SamplingConfig()


@dataclass(frozen=True)
class GenerationResult:
    """New tokens and how the request was served.

    ``first_logits`` are the float32 logits the first new token was chosen from (the
    quantity compared between cached and uncached runs).
    """

    tokens: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    stored_blocks: int
    ttft_s: float
    total_s: float
    first_logits: torch.Tensor
    stored_output_blocks: int = 0  # blocks completed by generated tokens, newly put


def _choose(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    if sampling.temperature == 0.0:
        return int(torch.argmax(logits).item())
    scores = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _eos_ids(model: Any, eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


@torch.inference_mode()
def generate(
    model: Any,
    tokens: Sequence[int],
    *,
    store: "StoreAPI | None" = None,
    scope: Scope | None = None,
    max_new_tokens: int = 32,
    sampling: SamplingConfig = GREEDY,
    eos_token_id: int | Sequence[int] | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    store_new: bool = True,
    store_output: bool = True,
    progress: Progress | None = None,
    on_store_error: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``tokens``, restoring the prompt's longest
    stored prefix from ``store`` (when given) and storing its new full blocks (when
    ``store_new``), then, when ``store_new`` and ``store_output``, the full blocks that the
    generated tokens completed (all but the last token have KV). Stops at an
    end-of-sequence token (``eos_token_id``, default the model's generation config) or at
    the model's context. ``progress(done, total)`` gets the prompt's prefill in tokens
    (:func:`cached_prefill`'s): restored, then after each computed chunk. With
    ``on_store_error`` a full or failing disk does not fail the request
    (:func:`~tierkv.hf.prefill.put_what_fits`).

    Raises ConfigError when the prompt alone exceeds the model's context length.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = context_length(model.config)
    if limit is not None and len(tokens) >= limit:
        raise ConfigError(
            f"the prompt has {len(tokens)} tokens; the model's context is {limit}",
            hint="use a shorter prefix (materialize --max-tokens) or a shorter prompt",
        )
    start = time.perf_counter()
    pre = cached_prefill(model, tokens, store=store, scope=scope, chunk_tokens=chunk_tokens, store_new=store_new,
                         progress=progress, on_store_error=on_store_error)
    assert pre.logits is not None  # cached_prefill(need_logits=True) always computes the last token
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=pre.logits.device).manual_seed(sampling.seed)
    eos = _eos_ids(model, eos_token_id)
    first_logits = pre.logits
    next_id = _choose(first_logits, sampling, generator)
    ttft = time.perf_counter() - start
    new = [next_id]
    cache = pre.cache
    budget = max_new_tokens if limit is None else min(max_new_tokens, limit - len(tokens))
    while len(new) < budget and next_id not in eos:
        step = torch.tensor([[next_id]], device=model.device)
        out = model(input_ids=step, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        next_id = _choose(out.logits[0, -1].float(), sampling, generator)
        new.append(next_id)
    total = time.perf_counter() - start  # the answer is complete; storing it is not latency
    stored_output = 0
    if store is not None and scope is not None and store_new and store_output:
        stored_output = _store_output(store, scope, [int(t) for t in tokens] + new[:-1], len(tokens), cache,
                                      on_store_error)
    return GenerationResult(
        tokens=tuple(new),
        prompt_tokens=pre.prompt_tokens,
        cached_tokens=pre.cached_tokens,
        stored_blocks=pre.stored_blocks,
        ttft_s=ttft,
        total_s=total,
        first_logits=first_logits,
        stored_output_blocks=stored_output,
    )


def _store_output(store: "StoreAPI", scope: Scope, seq: list[int], prompt_len: int, cache: Any,
                  on_store_error: Callable[[str], None] | None) -> int:
    """Put the blocks of ``seq`` (prompt + generated tokens with KV in ``cache``) past the
    prompt's full blocks, which the prefill stored; returns how many were new."""
    bs = store.layout.block_size
    first, full = prompt_len // bs, len(seq) // bs
    if full <= first:
        return 0
    pages = pack_pages(cache_layer_kv(cache), store.layout, first * bs, full - first)
    return put_what_fits(store, seq[: full * bs], pages, scope, start_block=first, on_store_error=on_store_error)
