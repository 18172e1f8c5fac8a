"""Batched greedy decoding of prompts that share a cached prefix, reading the prefix in place.

``generate_batch`` makes sure the prefix's full blocks are in the store (prefilling it once
when they are not), takes **one** lease on them for the whole batch, and runs the model on
all requests together with the ``"tierkv_cascade"`` attention function
(:mod:`tierkv.hf.cascade_attention`): the prefix K/V are read from the leased device-tier
pages, never copied per request, and each request keeps only its own suffix K/V (its
prompt past the shared part, then its generated tokens) in a small paged pool.

What is shared: ``shared_tokens`` = the leased full blocks of the prefix, cut to one token
short of the shortest prompt (the last prompt token must go through the model to give the
first logits, so a prompt equal to a block-aligned prefix recomputes that prefix's last
token in its suffix). A partial last block of the prefix is never in the store: it belongs
to each request's suffix.

Steps: one suffix prefill call for the whole batch (prompts right-padded; PyTorch attention
over the prefix gathered once per layer), then one decode call per generated token for the
requests still running (Triton kernels: cascade or plain paged for the prefix, paged for
the suffix, merged). Rotary positions of request ``n`` continue from ``shared_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch

from ..errors import ConfigError, InvalidTokensError, PageFormatError
from ..identity import Scope
from ..layout import PageLayout
from .cascade_attention import STATE_KWARG, BatchAttention, SuffixPages, swapped_attention
from .config import context_length, layout_from_model, text_config
from .model import LoadedModel
from .prefill import cached_prefill

if TYPE_CHECKING:
    from ..api import StoreAPI


@dataclass(frozen=True)
class BatchResult:
    """New tokens per prompt and what the batch held.

    ``prefix_bytes_held`` is the leased device pages (held once for all requests);
    ``per_request_suffix_bytes[n]`` the private suffix pages of request ``n``. Without
    sharing, every request would hold its own copy: ``copied_prefix_bytes``.
    """

    tokens: tuple[tuple[int, ...], ...]
    shared_tokens: int  # prefix tokens every request read in place from the lease
    prefix_blocks: int  # blocks leased (once)
    stored_blocks: int  # prefix blocks this call prefilled and put into the store
    prefix_bytes_held: int
    per_request_suffix_bytes: tuple[int, ...]
    cascade_steps: int  # decode steps whose prefix part ran the cascade kernel
    plain_steps: int  # decode steps whose prefix part ran the plain paged kernel

    @property
    def copied_prefix_bytes(self) -> int:
        return len(self.tokens) * self.prefix_bytes_held


def _common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    first = list(prompts[0])
    end = len(first)
    for p in prompts[1:]:
        end = min(end, len(p))
        end = next((i for i in range(end) if p[i] != first[i]), end)
    return first[:end]


def _eos_ids(model: Any, eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _resolve(lm_or_model: Any, scope: Scope | None, namespace: str) -> tuple[Any, Scope]:
    if isinstance(lm_or_model, LoadedModel):
        return lm_or_model.model, scope or lm_or_model.scope(namespace)
    if scope is None:
        raise ValueError("generate_batch needs a scope when given a bare model (or pass a LoadedModel)")
    return lm_or_model, scope


class _Checked(NamedTuple):
    requests: list[list[int]]
    prefix: list[int]
    budgets: list[int]  # tokens each request may generate (max_new_tokens, or less near the context end)
    text_config: Any


def _check(model: Any, prompts: Sequence[Sequence[int]], prefix_tokens: Sequence[int] | None, layout: PageLayout,
           max_new_tokens: int) -> _Checked:
    """The validation of :func:`generate_batch` (see its docstring for what is raised)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidTokensError("generate_batch needs at least one prompt, each non-empty",
                                 hint="drop empty prompts before batching")
    requests = [[int(t) for t in p] for p in prompts]
    prefix = [int(t) for t in prefix_tokens] if prefix_tokens is not None else _common_prefix(requests)
    if any(p[: len(prefix)] != prefix for p in requests):
        raise InvalidTokensError("every prompt must start with prefix_tokens",
                                 hint="batch only prompts that share the prefix, or pass prefix_tokens=None")
    if layout_from_model(model, layout.block_size) != layout:
        raise PageFormatError(
            f"the model's KV layout {layout_from_model(model, layout.block_size).to_json()} differs from the "
            f"store's {layout.to_json()}", hint="open a store home made for this model (another --home)")
    limit = context_length(model.config)
    if limit is not None and max(len(p) for p in requests) >= limit:
        raise ConfigError(f"a prompt has {max(len(p) for p in requests)} tokens; the model's context is {limit}",
                          hint="use shorter prompts")
    budgets = [max_new_tokens if limit is None else min(max_new_tokens, limit - len(p)) for p in requests]
    text = text_config(model.config)
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) and \
            max(len(p) + b for p, b in zip(requests, budgets)) > window:
        # The kernels attend to the whole context; the model would drop keys older than the window.
        raise ConfigError(f"a request would outgrow the model's sliding window of {window} tokens",
                          hint="shorten the prompts or max_new_tokens, or generate them one at a time")
    return _Checked(requests, prefix, budgets, text)


@torch.inference_mode()
def generate_batch(
    lm_or_model: Any,
    prompts: Sequence[Sequence[int]],
    store: "StoreAPI",
    *,
    prefix_tokens: Sequence[int] | None = None,
    scope: Scope | None = None,
    namespace: str = "default",
    max_new_tokens: int = 32,
    eos_token_id: int | Sequence[int] | None = None,
    use_cascade: bool | None = None,
) -> BatchResult:
    """Greedy-decode up to ``max_new_tokens`` after each prompt, all prompts together.

    ``prompts`` must all start with ``prefix_tokens`` (default: their longest common
    prefix). ``lm_or_model`` is a :class:`~tierkv.hf.LoadedModel` (its scope is used unless
    ``scope`` is given) or a bare transformers causal LM with ``scope``; it must be on the
    store's device-tier device, in the store's layout. ``use_cascade`` forces the decode
    kernel of the prefix part (True: cascade, False: plain paged); None asks
    :func:`tierkv.kernels.should_use_cascade` each time the set of running requests changes.
    A request stops at an end-of-sequence token (``eos_token_id``, default the model's
    generation config) or at the model's context; the others go on.

    The model's attention implementation is switched for the call and restored after: do
    not run the same model from another thread meanwhile. Requires ``tierkv.kernels`` to
    be importable (on a CPU, ``TRITON_INTERPRET=1`` set before its first import).

    Raises InvalidTokensError for empty prompts or ones not starting with the prefix,
    ConfigError for a prompt that fills the model's context or a model not on the store's
    device, PageFormatError when the model's KV layout is not the store's.
    """
    model, scope = _resolve(lm_or_model, scope, namespace)
    requests, prefix, budgets, text_config = _check(model, prompts, prefix_tokens, store.layout, max_new_tokens)
    layout = store.layout
    bs = layout.block_size
    full = len(prefix) // bs
    stored = 0
    if full and store.lookup(prefix[: full * bs], scope).num_blocks < full:
        # Prefill the prefix once with the model's own attention, before the switch below.
        stored = cached_prefill(model, prefix[: full * bs], store=store, scope=scope, need_logits=False).stored_blocks
    with store.acquire(prefix[: full * bs], scope, max_blocks=full) as lease:
        if lease.num_blocks and lease.pool.device != model.device:
            raise ConfigError(f"the model is on {model.device} but the store's device tier is on {lease.pool.device}",
                              hint="load the model on the store's device (StoreConfig.device)")
        shared = min(lease.tokens_matched, min(len(p) for p in requests) - 1)
        suffix = SuffixPages.allocate(layout, [len(p) - shared + b for p, b in zip(requests, budgets)], model.device)
        state = BatchAttention(lease.pool, list(lease.slots[: -(-shared // bs)]), shared, suffix,
                               int(text_config.num_attention_heads), use_cascade)
        with swapped_attention(model):
            new = _decode_all(model, requests, shared, budgets, _eos_ids(model, eos_token_id), state)
        suffix.check_integrity()
        return BatchResult(
            tokens=tuple(tuple(t) for t in new), shared_tokens=shared, prefix_blocks=lease.num_blocks,
            stored_blocks=stored, prefix_bytes_held=lease.num_blocks * layout.page_bytes,
            per_request_suffix_bytes=tuple(suffix.bytes_of(n) for n in range(len(requests))),
            cascade_steps=state.cascade_steps, plain_steps=state.plain_steps,
        )


def _decode_all(model: Any, prompts: list[list[int]], shared: int, budgets: list[int], eos: set[int],
                state: BatchAttention) -> list[list[int]]:
    """The suffix prefill of every prompt in one call, then one call per generated token."""
    device, n = model.device, len(prompts)
    own = [p[shared:] for p in prompts]
    lens = [len(s) for s in own]
    width = max(lens)
    ids = torch.zeros((n, width), dtype=torch.long)
    for i, s in enumerate(own):
        ids[i, : len(s)] = torch.tensor(s)
    positions = (shared + torch.arange(width)).expand(n, width)
    state.begin_prefill(list(range(n)), lens)
    logits = model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False,
                   **{STATE_KWARG: state}).logits
    state.end_step()
    last = logits[torch.arange(n, device=device), torch.tensor(lens, device=device) - 1]
    new = [[int(t)] for t in torch.argmax(last.float(), dim=-1).tolist()]
    active = [i for i in range(n) if len(new[i]) < budgets[i] and new[i][-1] not in eos]
    while active:
        step = torch.tensor([[new[i][-1]] for i in active], device=device)
        # Position of the fed token = tokens of the request's context before it.
        positions = torch.tensor([[shared + int(state.suffix.lens[i])] for i in active], device=device)
        state.begin_decode(active)
        logits = model(input_ids=step, position_ids=positions, use_cache=False, **{STATE_KWARG: state}).logits
        state.end_step()
        for i, t in zip(active, torch.argmax(logits[:, -1].float(), dim=-1).tolist()):
            new[i].append(int(t))
        active = [i for i in active if len(new[i]) < budgets[i] and new[i][-1] not in eos]
    return new
