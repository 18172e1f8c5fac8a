"""Cached prefill: restore the longest stored prefix into a DynamicCache, compute the rest.

The request's token ids are looked up in the store; the matched blocks are copied out of
the store under a lease (released before any compute) and appended to a fresh
``transformers.DynamicCache`` layer by layer. The remaining tokens are prefilled in chunks;
after each chunk the blocks it completed are cut out of the cache with
:func:`tierkv.layout.pack_pages` and put into the store, so an interrupted prefill resumes
from its last chunk.

When the caller needs logits, at least one token must go through the model: the restore
stops one token short of the prompt's end (at most ``(n - 1) // block_size`` blocks), so a
prompt whose length is an exact multiple of the block size recomputes its last block.

The cache is a ``DynamicCache()`` built without the model config on purpose: with a config,
transformers gives sliding-window models (Mistral) layers that drop keys older than the
window, and those keys are exactly what the next request's restore needs. A full cache plus
the model's sliding-window mask computes the same attention.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import torch

from ..errors import DiskWriteError, IndexWriteError, InvalidTokensError, PageFormatError
from ..identity import Scope, as_token_array
from ..layout import PageLayout, kv_layers, pack_pages
from ..lease_windows import LeaseWindows
from .config import layout_from_model

from ..core.blocks import Priority

if TYPE_CHECKING:
    from ..api import StoreAPI

DEFAULT_CHUNK_TOKENS = 2048
# Blocks leased per restore window (at most RESTORE_WINDOW_BYTES of pages), and windows
# leased ahead of the copy: a window large enough that its reads are a few large requests,
# small enough that the copy left after the last read is short and that the read-through
# buffers of a cold restore (tierkv/core/read_through.py: one per window in flight, faulted in
# by their first reads) stay small (scripts/bench_ttft.py; docs/performance.md).
RESTORE_WINDOW_BLOCKS = 32
RESTORE_WINDOW_BYTES = 24 << 20
RESTORE_WINDOWS_AHEAD = 3
# Windows leased at once (tierkv/lease_windows.py): two, so the disk has the next window's reads
# while the last checksums and lookups of the one before run.
RESTORE_READERS = 2
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill produced.

    ``logits`` are the last token's logits ``[vocab]`` (float32), or None when the caller
    did not ask for them; ``cache`` holds the KV of all ``tokens_in_cache`` tokens (the
    whole prompt when logits were asked for). ``cached_tokens`` came from the store,
    ``computed_tokens`` went through the model, ``stored_blocks`` were newly written.
    """

    logits: torch.Tensor | None
    cache: Any
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    stored_blocks: int
    tokens_in_cache: int


class Restored(NamedTuple):
    """A restored prefix: the cache and how many tokens it holds."""

    cache: Any
    tokens: int


def empty_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def cache_from_kv(layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device, dtype: torch.dtype) -> Any:
    """A DynamicCache holding per-layer ``(K, V)`` tensors ``[1, Hkv, T, D]``.

    The cache takes the tensors themselves when they already have ``device`` and ``dtype``
    (do not modify them afterwards). ``DynamicLayer.update`` would concatenate them onto an
    empty tensor: a second full copy of the prefix, and on CPU a fresh allocation whose page
    faults cost more than the copy (a third of the restore time at 190 MB in
    scripts/bench_ttft.py). So each layer is initialised by an empty update and then handed
    the tensors, through the same ``keys``/``values`` attributes :func:`cache_layer_kv`
    reads; any other layer type gets a plain update.
    """
    from transformers.cache_utils import DynamicLayer

    cache = empty_cache()
    for layer_idx, (k, v) in enumerate(layer_kv):
        k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
        cache.update(k[:, :, :0], v[:, :, :0], layer_idx)
        layer = cache.layers[layer_idx]
        if type(layer) is DynamicLayer:
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, layer_idx)
    return cache


def cache_layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` of a DynamicCache, in transformers' ``[batch, H, T, D]`` layout."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _check_layout(model: Any, layout: PageLayout) -> None:
    mine = layout_from_model(model, layout.block_size)
    if mine != layout:
        raise PageFormatError(
            f"the model's KV layout {mine.to_json()} differs from the store's {layout.to_json()}",
            hint="open a store home made for this model (another --home)",
        )


def lease_kv(lease: Any, layout: PageLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` ``[1, H, n*B, D]`` of a lease's pages, in one buffer the caller
    owns (:meth:`tierkv.Lease.kv`), checked against the model's ``layout``. Call while the
    lease is held."""
    if lease.layout != layout:
        raise PageFormatError(f"the lease holds pages of layout {lease.layout}, the model needs {layout}")
    return lease.kv()


def restore_cache(store: "StoreAPI", tokens: Sequence[int], scope: Scope, blocks: int, model: Any) -> Restored:
    """A DynamicCache of the first ``blocks`` blocks of ``tokens`` (fewer when fewer are
    stored), on ``model``'s device and dtype.

    Windows of :data:`RESTORE_WINDOW_BLOCKS` are leased by a helper thread, up to
    :data:`RESTORE_WINDOWS_AHEAD` ahead (:class:`tierkv.lease_windows.LeaseWindows`): the
    disk reads run back to back while this thread copies the windows already read into the
    cache's buffer, so only the last window's copy follows the last read. The windows are
    leased with ``promote=False``: a prefix read from disk for the first time is read into
    the leases' own buffers, not the device tier (tierkv/core/read_through.py; the next restore
    promotes it). Every copied page was verified by its lease; the restore ends at the
    first block that cannot be leased (evicted, corrupt, the device tier full)."""
    if blocks == 0:
        return Restored(empty_cache(), 0)
    layout = store.layout
    bs = layout.block_size
    # One int32 array for the lookup and every window's acquire (slices of it are views):
    # a list would be converted again by each of them.
    arr = as_token_array(tokens)[: blocks * bs]
    want = min(blocks, store.lookup(arr, scope).num_blocks)
    if want == 0:
        return Restored(empty_cache(), 0)
    got = 0
    half = layout.num_layers // 2
    with ThreadPoolExecutor(1, thread_name_prefix="tierkv-restore-copy") as helper, \
            LeaseWindows(store, arr, scope, want, ahead=RESTORE_WINDOWS_AHEAD, promote=False, readers=RESTORE_READERS,
                         window_blocks=max(1, min(RESTORE_WINDOW_BLOCKS, RESTORE_WINDOW_BYTES // layout.page_bytes))) as windows:
        # One tensor per layer's K and V (kv_layers: heap memory a process reuses, where one
        # large buffer is faulted in afresh every time); two threads copy each window, half
        # the layers each (numpy copies without the GIL), so the copy of a prefix already in
        # memory takes both cores.
        kv = kv_layers(layout, want, torch.device(model.device))
        for lease in windows:
            try:  # the lease is released only after the copy: its pages stay put until then
                if lease.layout != layout:
                    raise PageFormatError(f"the lease holds pages of layout {lease.layout}, the model needs {layout}")
                other = helper.submit(lease.kv_into, kv, got, (0, half))
                try:
                    lease.kv_into(kv, got, (half, layout.num_layers))
                finally:
                    other.result()
                got += lease.num_blocks
            finally:
                lease.release()
    if got == 0:
        return Restored(empty_cache(), 0)
    layer_kv = kv
    if got < want:  # a short restore: compact, so the cache owns contiguous tensors
        layer_kv = [(k[:, :, : got * bs].contiguous(), v[:, :, : got * bs].contiguous()) for k, v in kv]
    return Restored(cache_from_kv(layer_kv, model.device, model.dtype), got * bs)


def put_what_fits(store: "StoreAPI", tokens: Sequence[int], pages: torch.Tensor, scope: Scope, *, start_block: int,
                  priority: Priority = Priority.NORMAL, on_store_error: Callable[[str], None] | None = None) -> int:
    """``store.put`` of a request's new blocks; returns how many were stored. With
    ``on_store_error`` a disk or index write that fails (a full disk: DiskWriteError,
    IndexWriteError) does not fail the request: the message goes to ``on_store_error`` and
    the put is tried once more, which keeps the blocks in memory now that the disk tier is
    degraded (a second failure stores nothing). What was stored before stays. The answer
    comes, as a daemon's does once its disk tier is degraded (issue #37, item 3); without
    ``on_store_error`` the error propagates (materialize: a prefix that cannot be made
    durable is an error)."""
    try:
        return store.put(tokens, pages, scope, start_block=start_block, priority=priority).stored
    except (DiskWriteError, IndexWriteError) as e:
        if on_store_error is None:
            raise
        failure = e.message
    try:
        stored = store.put(tokens, pages, scope, start_block=start_block, priority=priority).stored
        on_store_error(f"{failure}; the answer goes on, {stored} of its blocks kept in memory only")
        return stored
    except (DiskWriteError, IndexWriteError):
        on_store_error(f"{failure}; the answer goes on without storing {len(pages)} of its blocks")
        return 0


@torch.inference_mode()
def cached_prefill(
    model: Any,
    tokens: Sequence[int],
    *,
    store: "StoreAPI | None" = None,
    scope: Scope | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    need_logits: bool = True,
    store_new: bool = True,
    priority: Priority = Priority.NORMAL,
    progress: Progress | None = None,
    on_store_error: Callable[[str], None] | None = None,
) -> PrefillResult:
    """Prefill ``tokens`` (one sequence) with ``model``, reusing and extending ``store``.

    Without a store this is a plain chunked prefill. With one (and its ``scope``), the
    longest stored prefix is restored, the rest is computed ``chunk_tokens`` at a time and,
    if ``store_new``, every block completed by a chunk is put (durably) before the next
    chunk starts. ``need_logits=False`` (materialising a prefix) restores every stored full
    block and computes nothing when all of them are stored. ``progress(done, total)`` is
    called with token counts after the restore and after each chunk. ``on_store_error``:
    see :func:`put_what_fits`.

    Raises InvalidTokensError for an empty or malformed prompt, PageFormatError when the
    model's KV layout is not the store's, and whatever the store raises.
    """
    ids = as_token_array(tokens).astype("int64")
    n = len(ids)
    if n == 0:
        raise InvalidTokensError("cannot prefill an empty prompt", hint="pass at least one token")
    token_list = ids.tolist()
    if store is not None:
        if scope is None:
            raise ValueError("cached_prefill needs a scope together with a store")
        store_scope: Scope = scope
        layout = store.layout
        _check_layout(model, layout)
        bs = layout.block_size
        max_blocks = (n - 1) // bs if need_logits else n // bs
        if not need_logits and store.lookup(token_list, scope).num_blocks >= max_blocks:
            # Everything that can be stored is stored: no restore, no compute.
            if progress is not None:
                progress(max_blocks * bs, max_blocks * bs)
            return PrefillResult(None, empty_cache(), n, max_blocks * bs, 0, 0, 0)
        cache, pos = restore_cache(store, token_list, store_scope, max_blocks, model)
    else:
        layout, bs = None, 1
        cache, pos = empty_cache(), 0
    # Materialising (no logits) stops at the last full block: a partial tail is never stored.
    target = n if need_logits or store is None else n // bs * bs
    cached = pos
    if progress is not None:
        progress(pos, target)
    chunk = max(bs, chunk_tokens // bs * bs)
    input_ids = torch.from_numpy(ids).to(model.device).unsqueeze(0)
    stored_upto = pos // bs  # blocks [0, stored_upto) are in the store
    stored = 0
    logits = None
    while pos < target:
        end = min(pos + chunk, target)
        out = model(input_ids=input_ids[:, pos:end], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        pos = end
        if store is not None and store_new and layout is not None and pos // bs > stored_upto:
            full = pos // bs
            pages = pack_pages(cache_layer_kv(cache), layout, stored_upto * bs, full - stored_upto)
            stored += put_what_fits(store, token_list[: full * bs], pages, store_scope, start_block=stored_upto,
                                    priority=priority, on_store_error=on_store_error)
            stored_upto = full
        if pos == n and need_logits:
            logits = out.logits[0, -1].float()
        if progress is not None:
            progress(pos, target)
    return PrefillResult(logits, cache, n, cached, pos - cached, stored, pos)
