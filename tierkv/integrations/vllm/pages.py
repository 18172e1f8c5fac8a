"""The edge between vLLM's paged KV caches and tierkv pages.

vLLM 0.32 hands the connector one tensor per attention layer, a standardized logical view
``[num_kernel_blocks, num_kv_heads, kernel_block_tokens, 2 * head_dim]`` (RFC #42082). How
K and V share the last two axes is the attention backend's business:

* ``CPU_ATTN`` splits each (block, head) tile of ``2 * tokens * head_dim`` elements in
  halves: K first, stored transposed (``[head_dim, tokens]``, what its ``vec``/``vec16``
  kernels read), then V as ``[tokens, head_dim]`` (:data:`KV_BY_TOKENS`); with its ``amx``
  kernels (bfloat16 on a CPU with AMX tiles, kernel blocks of a multiple of 32 tokens) the
  halves are packed for the tile loads instead (:data:`KV_AMX`, :func:`_amx_views`);
* ``FLASH_ATTN`` and ``TRITON_ATTN`` split the last axis: ``[..., :head_dim]`` is K and
  ``[..., head_dim:]`` is V (:data:`KV_BY_CHANNELS`).

:class:`PagedKV` turns each layer into canonical strided views ``[kernel_blocks, H, tokens,
D]`` of K and of V (same memory), so gathering and scattering a page is the same code for
both. Pages hold K and V as the model computed them, so pages written by vLLM and by
``tierkv materialize`` (transformers) are interchangeable. A vLLM (manager) block may span
several kernel blocks (``block_size`` 64 with kernel blocks of 32); their tokens are
concatenated in order. A tierkv page is
``[num_layers, 2, block_size, num_kv_heads, head_dim]``.

fp8 caches (``kv_cache_dtype`` fp8/fp8_e4m3/fp8_e5m2, allocated by vLLM as uint8) are moved
as bytes: pages hold the codes the engine's kernels wrote, bit for bit. Whether those
kernels lay fp8 K out as the ``tokens`` split says matters only for reading pages written
elsewhere; a page vLLM saved and loads back is the same tile bytes either way, and fp8
model versions name the CPU kernel ISA (config.kv_format), so only engines with the
same kernels share them.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ...layout import PageLayout
from .copies import copy_strided

KV_BY_TOKENS = "tokens"
KV_BY_CHANNELS = "channels"
KV_AMX = "amx"  # CPU_ATTN's tiles as its amx kernels pack them (cpu_attn_kv_split)
BACKEND_KV_SPLIT = {
    "CPU_ATTN": KV_BY_TOKENS,
    "FLASH_ATTN": KV_BY_CHANNELS,
    "TRITON_ATTN": KV_BY_CHANNELS,
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
# numpy has no bfloat16 or float8: copy the bytes as same-width ints.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# A CPU load or save of at least this many bytes is copied in two halves (by block), one of
# them on PagedKV's helper thread: numpy drops the GIL in these copies, and one thread does
# not reach memory's speed on CPU_ATTN's transposed K (8 MiB of K 2.9 ms, of V 1.0 ms).
# 16 MiB (32 blocks of 128 tokens, 8 layers, bf16) took 2.6 ms against 4.8 ms on one thread
# (2-vCPU VM, 2026-12-07, docs/performance-history.md); a load runs inside vLLM's step.
SPLIT_COPY_BYTES = 4 << 20


def _cache_dtype_ok(cache: torch.Tensor, layout: PageLayout) -> bool:
    """vLLM allocates fp8 caches as uint8 (its kernels write the fp8 codes); pages name the
    fp8 type, and the bytes are the same."""
    if cache.dtype == layout.torch_dtype:
        return True
    return layout.torch_dtype.itemsize == 1 and layout.torch_dtype.is_floating_point and cache.dtype == torch.uint8


class UnsupportedCacheError(Exception):
    """vLLM's KV caches do not have a shape this module can map to pages."""


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order (``model.layers.10.`` after ``model.layers.9.``)."""
    def index(name: str) -> int:
        found = _LAYER_INDEX.findall(name)
        if not found:
            raise UnsupportedCacheError(f"cannot tell the layer index of {name!r}")
        return int(found[-1])

    return sorted(names, key=index)


def canonical_view(cache: torch.Tensor, layout: PageLayout, num_blocks: int,
                   kv_split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``[kernel_blocks, H, kernel_block_tokens, D]`` of K and of V in one layer's cache
    (no copy; writes through them land in vLLM's cache); for :data:`KV_AMX` 6-d views whose
    tokens and channels are two axes each (:func:`_amx_views`, :func:`_split_axes`)."""
    H, D, B = layout.num_kv_heads, layout.head_dim, layout.block_size
    if cache.dim() != 4 or cache.shape[1] != H or cache.shape[3] != 2 * D:
        raise UnsupportedCacheError(f"KV cache of shape {tuple(cache.shape)} is not [blocks, {H}, tokens, {2 * D}]")
    if num_blocks <= 0 or cache.shape[0] % num_blocks:
        raise UnsupportedCacheError(f"{cache.shape[0]} kernel blocks is not a multiple of {num_blocks} vLLM blocks")
    ratio = cache.shape[0] // num_blocks
    n = cache.shape[2]
    if ratio * n != B:
        raise UnsupportedCacheError(f"{ratio} kernel blocks of {n} tokens do not make a block of {B}")
    if not _cache_dtype_ok(cache, layout):
        raise UnsupportedCacheError(f"KV cache dtype {cache.dtype} differs from the page dtype {layout.dtype}")
    if layout.torch_dtype.itemsize == 1:
        cache = cache.view(torch.uint8)  # fp8: views and copies move bytes (torch indexes uint8 everywhere)
    try:
        if kv_split == KV_AMX:
            return _amx_views(cache, H, n, D)
        if kv_split == KV_BY_TOKENS:  # K transposed ([D, n]), then V ([n, D])
            k = cache.view(cache.shape[0], H, 2, D, n)[:, :, 0].transpose(2, 3)
            return k, cache.view(cache.shape[0], H, 2, n, D)[:, :, 1]
        if kv_split == KV_BY_CHANNELS:
            kv = cache.view(cache.shape[0], H, n, 2, D)
            return kv[:, :, :, 0], kv[:, :, :, 1]
    except RuntimeError as e:  # view() refuses strides that do not split this way
        raise UnsupportedCacheError(f"KV cache strides {cache.stride()} cannot be split into K and V: {e}") from e
    raise UnsupportedCacheError(f"unknown K/V split {kv_split!r}")


def _amx_views(cache: torch.Tensor, H: int, n: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of CPU_ATTN's ``amx`` tiles as 6-d views ``[kernel_blocks, H, t1, t2, d1, d2]``
    (token ``t1 * t2_size + t2``, channel ``d1 * d2_size + d2``): no single stride walks
    the tokens or the channels of one head here, so each is split in two axes.

    Read off vLLM 0.32's own ``cpu_attn_reshape_and_cache`` (the ground-truth test in
    tests/integrations/test_vllm.py), for bf16 K and V of a (block, head):

    * K half: ``[n/16, D/2, 16, 2]``: 16-token groups, and inside one a row per channel pair
      holding (token, even channel), (token, odd channel) for its 16 tokens (the pair layout
      of the AMX bf16 dot product over the head dimension);
    * V half: ``[D/16, n/2, 16, 2]``: 16-channel groups, and inside one a row per token pair
      holding (even token, channel), (odd token, channel) for its 16 channels.
    """
    if n % 16 or D % 16:
        raise UnsupportedCacheError(f"amx tiles need kernel blocks and head_dim in multiples of 16, got {n} and {D}")
    kb = cache.shape[0]
    k = cache.view(kb, H, 2, n // 16, D // 2, 16, 2)[:, :, 0]  # [kb, H, t1, d1, t2, d2]
    v = cache.view(kb, H, 2, D // 16, n // 2, 16, 2)[:, :, 1]  # [kb, H, d1, t1, d2, t2]
    return k.permute(0, 1, 2, 4, 3, 5), v.permute(0, 1, 3, 5, 2, 4)


def _split_axes(view: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token axes and the channel axes of a canonical view (after ``[blocks, H]``): one
    of each in a 4-d view, two of each in a 6-d one (:func:`_amx_views`)."""
    rest = tuple(view.shape[2:])
    half = len(rest) // 2
    return rest[:half], rest[half:]


# Above this many runs a load copies with one indexed copy per layer and K/V (PagedKV._copy_np).
_MAX_RUN_COPIES = 8


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(a, b, length) runs of pairs in which both members count up by one: a run of pool
    slots landing in a run of vLLM blocks is one copy per layer, whatever the block size."""
    runs: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


class PagedKV:
    """vLLM's per-layer KV caches, read and written one tierkv page per vLLM block.

    Holds views of vLLM's tensors (not copies); callers must only touch blocks the scheduler
    assigned to requests of the current step.

    On the CPU every copy is a numpy ``copyto`` between strided views (the bytes seen as
    same-width integers): torch's ``index_select``/``index_put_`` over these views ran at a
    fraction of memcpy speed on 2 cores and paid torch's intra-op dispatch per call, numpy
    copies at memory speed without the GIL, and runs of consecutive blocks are one call per
    layer, so a small block size costs no more calls than a large one.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layout: PageLayout, num_blocks: int,
                 kv_split: str) -> None:
        names = layer_order(list(kv_caches))
        if len(names) != layout.num_layers:
            raise UnsupportedCacheError(f"{len(names)} KV cache layers, the model has {layout.num_layers}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.layer_names = names
        self.kv_split = kv_split
        self.views = [canonical_view(kv_caches[n], layout, num_blocks, kv_split) for n in names]  # (K, V)
        self._axes = tuple(_split_axes(x) for x in self.views[0])  # per K/V: (token axes, channel axes)
        self.ratio = self.views[0][0].shape[0] // num_blocks
        self.device = self.views[0][0].device
        self._np = None
        if self.device.type == "cpu":
            as_int = _INT_OF_WIDTH[layout.torch_dtype.itemsize]
            # [vLLM blocks, ratio, H, n, D] per layer and K/V: numpy views of vLLM's memory.
            self._np = [tuple(self._blocked(x.view(as_int).numpy()) for x in kv) for kv in self.views]
            self._as_int = as_int
        # Owned here, shut down by close(); started now, so no step pays for its thread.
        self._helper: ThreadPoolExecutor | None = None
        if self._np is not None and len(os.sched_getaffinity(0)) > 1:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="tierkv-vllm-copy")
            self._helper.submit(lambda: None).result()

    def close(self) -> None:
        """Stop the copy helper thread (after the copy in flight, if any)."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)

    def _in_halves(self, n: int, copy: Callable[[int, int], None]) -> None:
        """``copy(lo, hi)`` over items ``[0, n)``: in two halves, the second on the helper
        thread, when ``n`` pages are at least SPLIT_COPY_BYTES; returns once both ended."""
        if self._helper is None or n < 2 or n * self.layout.page_bytes < SPLIT_COPY_BYTES:
            copy(0, n)
            return
        half = n // 2
        other = self._helper.submit(copy, half, n)
        try:
            copy(0, half)
        finally:
            err = other.exception()  # waits: nothing writes into either side once this returns
        if err is not None:
            raise err

    def _blocked(self, x: np.ndarray) -> np.ndarray:
        """A layer's ``[kernel_blocks, H, n, D]`` as ``[vLLM blocks, ratio, H, n, D]`` (a view)."""
        r = self.ratio
        return np.lib.stride_tricks.as_strided(x, (self.num_blocks, r, *x.shape[1:]), (x.strides[0] * r, *x.strides))

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        if any(b < 0 or b >= self.num_blocks for b in block_ids):
            raise IndexError(f"block ids out of range [0, {self.num_blocks})")

    def _page_view(self, pages: np.ndarray, layer: int, kind: int) -> np.ndarray:
        """``pages[:, layer, kind]`` ([k, B, H, D]) seen as [k, ratio, H, n, D], the tokens
        and channels split into the axes of the cache's views (``_axes``)."""
        L = self.layout
        x = pages[:, layer, kind]
        tokens, channels = self._axes[kind]
        y = x.reshape(x.shape[0], self.ratio, *tokens, L.num_kv_heads, *channels)  # splits dims: always a view
        assert np.may_share_memory(y, x) or not x.size, "a page view must not be a copy"
        h = 2 + len(tokens)  # the head axis
        return y.transpose(0, 1, h, *range(2, h), *range(h + 1, y.ndim))

    def _kernel_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise IndexError(f"block ids out of range [0, {self.num_blocks})")
        r = self.ratio
        return (ids[:, None] * r + torch.arange(r)[None, :]).reshape(-1).to(self.device)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Pages ``[len(block_ids), L, 2, B, H, D]`` copied out of the given vLLM blocks."""
        L = self.layout
        k, r = len(block_ids), self.ratio
        if self._np is not None:
            self._check_ids(block_ids)
            # torch.empty, not np.empty: numpy asks for transparent huge pages on arrays this
            # size, and a huge-page fault that makes the kernel compact memory can stall this
            # copy, which runs inside vLLM's step, for hundreds of milliseconds.
            out = torch.empty((k, *L.shape), dtype=_INT_OF_WIDTH[L.torch_dtype.itemsize]).numpy()
            views = self._np

            def gather_part(lo: int, hi: int) -> None:
                for i, b, m in _runs([(i, block_ids[i]) for i in range(lo, hi)]):
                    for layer, kv in enumerate(views):
                        for kind in (0, 1):
                            copy_strided(self._page_view(out[i : i + m], layer, kind), kv[kind][b : b + m])

            self._in_halves(k, gather_part)
            return torch.from_numpy(out).view(L.torch_dtype)
        idx = self._kernel_index(block_ids)
        per_layer = []
        H, n, D = L.num_kv_heads, L.block_size // r, L.head_dim
        for k_view, v_view in self.views:  # reshape: a 6-d view's selection ([k*r, H, t1, t2, d1, d2]) as [k*r, H, n, D]
            x = torch.stack([k_view.index_select(0, idx).reshape(-1, H, n, D),
                             v_view.index_select(0, idx).reshape(-1, H, n, D)], dim=2)  # [k*r, H, 2, n, D]
            x = x.reshape(k, r, L.num_kv_heads, 2, -1, L.head_dim).permute(0, 3, 1, 4, 2, 5)
            per_layer.append(x.reshape(k, 2, L.block_size, L.num_kv_heads, L.head_dim))
        return torch.stack(per_layer, dim=1).contiguous().view(L.torch_dtype)

    def scatter(self, pages: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write pages ``[len(block_ids), L, 2, B, H, D]`` into the given vLLM blocks."""
        L = self.layout
        L.check_pages(pages, len(block_ids))
        if self._np is not None and pages.device.type == "cpu":
            self._check_ids(block_ids)
            self._copy_np(pages, range(len(block_ids)), block_ids)
            return
        k, r = len(block_ids), self.ratio
        idx = self._kernel_index(block_ids)
        pages = pages.to(self.device).view(self.views[0][0].dtype)  # fp8 pages as the uint8 views' bytes
        for layer, (k_view, v_view) in enumerate(self.views):
            x = pages[:, layer].reshape(k, 2, r, -1, L.num_kv_heads, L.head_dim)
            x = x.permute(0, 2, 4, 1, 3, 5).reshape(k * r, L.num_kv_heads, 2, -1, L.head_dim)
            k_view[idx] = x[:, :, 0].reshape(-1, *k_view.shape[1:])  # index_put_ on a view writes into vLLM's cache
            v_view[idx] = x[:, :, 1].reshape(-1, *v_view.shape[1:])

    def copy_in(self, pool: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy ``pool[slots[i]]`` (pages ``[*, L, 2, B, H, D]``, e.g. a tierkv device pool
        under a lease) into vLLM block ``block_ids[i]``, with no intermediate buffer."""
        if len(slots) != len(block_ids):
            raise ValueError(f"{len(slots)} pages for {len(block_ids)} blocks")
        if self._np is None or pool.device.type != "cpu":
            idx = torch.as_tensor(list(slots), dtype=torch.long, device=pool.device)
            as_bytes = pool.view(torch.uint8) if pool.element_size() == 1 else pool
            self.scatter(as_bytes.index_select(0, idx).view(pool.dtype), block_ids)
            return
        self._check_ids(block_ids)
        self._copy_np(pool, slots, block_ids)

    def _copy_np(self, pool: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        src = pool.view(self._as_int).numpy()
        self._in_halves(len(slots), lambda lo, hi: self._copy_np_part(src, slots[lo:hi], block_ids[lo:hi]))

    def _copy_np_part(self, src: np.ndarray, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        assert self._np is not None
        runs = _runs(list(zip(slots, block_ids)))
        if len(runs) > _MAX_RUN_COPIES and self.kv_split != KV_AMX:  # amx: copy_strided's pair moves, run by run
            # Scattered slots (pages promoted one by one land wherever the pool had room):
            # one indexed copy per layer and K/V instead of one copy per run. 4,096 tokens in
            # 128 scattered blocks of 32: 9.6 ms against 32 ms run by run (contiguous: 9.4 ms);
            # few long runs are faster copied as runs (block 128, one run: 8.4 ms against 11).
            s, b = np.asarray(slots, dtype=np.intp), np.asarray(block_ids, dtype=np.intp)
            for layer, kv in enumerate(self._np):
                for kind in (0, 1):
                    kv[kind][b] = self._page_view(src, layer, kind)[s]
            return
        for s, b, m in runs:
            for layer, kv in enumerate(self._np):
                for kind in (0, 1):
                    copy_strided(kv[kind][b : b + m], self._page_view(src[s : s + m], layer, kind))


def backend_kv_split(vllm_config: object, layer_names: Sequence[str], cache_dtype: torch.dtype) -> str:
    """The K/V split of the attention backend serving ``layer_names`` (one for all), whose
    caches hold ``cache_dtype``."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)  # type: ignore[arg-type]
    names = {layer.attn_backend.get_name() for layer in layers.values()}
    if len(names) != 1:
        raise UnsupportedCacheError(f"layers use several attention backends {sorted(names)}")
    name = names.pop()
    if name not in BACKEND_KV_SPLIT:
        raise UnsupportedCacheError(f"attention backend {name} is not supported (known: {sorted(BACKEND_KV_SPLIT)})")
    if name == "CPU_ATTN":
        isas = {getattr(layer, "isa", None) for layer in layers.values()}  # set by CPU_ATTN's metadata builder
        if None in isas:
            from .config import UnsupportedModelError, cpu_attn_isa

            try:
                isas = {cpu_attn_isa(vllm_config)}
            except UnsupportedModelError as e:
                raise UnsupportedCacheError(str(e)) from e
        if len(isas) != 1:
            raise UnsupportedCacheError(f"layers use several CPU attention ISAs {sorted(map(str, isas))}")
        return cpu_attn_kv_split(isas.pop(), cache_dtype)
    return BACKEND_KV_SPLIT[name]


def cpu_attn_kv_split(isa: str, cache_dtype: torch.dtype) -> str:
    """CPU_ATTN's split for the ISA its kernels run with: :data:`KV_AMX` for bf16 under the
    ``amx`` kernels, else :data:`KV_BY_TOKENS` (fp8 caches too: their codes are moved as
    bytes, and the ISA is part of their model version, config.kv_format)."""
    return KV_AMX if isa == "amx" and cache_dtype == torch.bfloat16 else KV_BY_TOKENS


def layer_kv_scales(vllm_config: object, layer_names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``(k_scale, v_scale)`` each attention layer quantises its fp8 cache with."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)  # type: ignore[arg-type]
    return {name: (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
            for name, layer in layers.items()}
