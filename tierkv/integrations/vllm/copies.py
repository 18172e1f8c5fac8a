"""Copies between strided numpy views of vLLM's KV tiles and tierkv pages, at memory speed
where numpy's own walk would not reach it (:class:`tierkv.integrations.vllm.pages.PagedKV`
calls :func:`copy_strided` for every load and save on the CPU)."""
from __future__ import annotations

import numpy as np


def copy_strided(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` with both walked in ``dst``'s memory order. numpy walks the axes as
    given; for CPU_ATTN's transposed K that wrote 2-byte elements a whole tile apart and ran
    at a tenth of the speed of the same copy with the axes reordered (one permutation applied
    to both sides, so the element pairs are the same).

    The amx tiles (:func:`tierkv.integrations.vllm.pages._amx_views`) keep 2-byte elements in pairs, and numpy's strided
    copies pay per run of the innermost axis: runs of two cost 9.2-9.8 ms for the 8 MiB of K
    in a 16 MiB load against 1.1-1.4 ms once each pair moves as one 4-byte int (K: a channel
    pair contiguous on both sides, ``_as_pairs``), and V's token pairs, contiguous in the tile
    only, are written as one int built from the two tokens (``_copy_interleaved``: 3.3 ms
    against 8.1 for its 8 MiB; V read out of the tile runs over 16 channels, 1.8 ms, as is).
    2-vCPU VM with AMX, one thread, 2026-12-07."""
    if dst.itemsize == 2 and dst.ndim and _pair_last(dst) and _pair_last(src):
        dst, src = _as_pairs(dst), _as_pairs(src)
    elif dst.itemsize == 2:
        for a in range(dst.ndim):
            if dst.shape[a] == 2 and dst.strides[a] == 2 and src.strides[a] != 2:
                _copy_interleaved(dst, src, a)
                return
    order = sorted(range(dst.ndim), key=lambda a: -abs(dst.strides[a]))
    np.copyto(dst.transpose(order), src.transpose(order))


def _pair_last(x: np.ndarray) -> bool:
    return x.shape[-1] == 2 and x.strides[-1] == x.itemsize


def _as_pairs(x: np.ndarray) -> np.ndarray:
    """``x`` (2-byte ints, last axis a contiguous pair) as 4-byte ints without that axis."""
    return x.view(np.int32)[..., 0]


def _copy_interleaved(dst: np.ndarray, src: np.ndarray, axis: int) -> None:
    """``dst[...] = src`` for 2-byte ints where ``dst``'s ``axis`` is a contiguous pair and
    ``src``'s is not: each pair is written as one 4-byte int, ``src``'s first member in the
    low half (little-endian: the first in memory), through one temporary."""
    d = _as_pairs(np.moveaxis(dst, axis, -1))
    s = np.moveaxis(src, axis, -1)
    both = np.left_shift(s[..., 1].view(np.uint16), 16, dtype=np.uint32)
    np.bitwise_or(both, s[..., 0].view(np.uint16), out=d.view(np.uint32))
