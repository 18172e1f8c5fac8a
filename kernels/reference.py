"""PyTorch references for the attention kernels: the definition the Triton code must match.

Everything here gathers pages out of the pool with ordinary indexing and runs plain softmax
attention in fp32, one request at a time. It is slow on purpose: no tiling, no online
softmax, no split-K, so a bug in the kernels' bookkeeping cannot hide in a shared helper.

Conventions shared by every function in ``tierkv.kernels``:

* ``pool`` is ``[num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]``;
  ``pool[slot, layer, 0]`` is K and ``pool[slot, layer, 1]`` is V of one page.
* A *part* of a request's context is a block table row plus a token range ``[start, end)``
  of the sequence that row describes: token ``t`` lives in page ``row[t // block_size]`` at
  offset ``t % block_size``.
* Query head ``h`` attends with KV head ``h // (num_q_heads // num_kv_heads)``.
* ``lse`` is the natural-log log-sum-exp of the scaled scores, fp32; an empty part has
  ``lse = -inf`` and output 0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .base import AttentionOutput


class ReferenceLevel(NamedTuple):
    """One shared level as the reference sees it (mirrors ``cascade.SharedLevel``)."""

    block_table: torch.Tensor  # [num_groups, max_blocks]
    kv_lens: torch.Tensor  # [num_groups]
    group_of_request: torch.Tensor  # [N]


def gather_kv(
    pool: torch.Tensor, layer: int, row: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[end - start, Hkv, D]`` of tokens ``[start, end)`` of one block table row."""
    block_size = pool.shape[3]
    tokens = torch.arange(start, end, device=pool.device, dtype=torch.int64)
    slots = row.to(pool.device, torch.int64)[tokens // block_size]
    offsets = tokens % block_size
    k = pool[slots, layer, 0, offsets]
    v = pool[slots, layer, 1, offsets]
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> AttentionOutput:
    """Softmax attention of one request's queries ``[Hq, D]`` over ``[T, Hkv, D]`` in fp32."""
    num_q_heads, head_dim = q.shape
    if k.shape[0] == 0:
        out = torch.zeros(num_q_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((num_q_heads,), -math.inf, dtype=torch.float32, device=q.device)
        return AttentionOutput(out, lse)
    group = num_q_heads // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)  # [T, Hq, D]
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q.float(), k32) * sm_scale
    lse = torch.logsumexp(scores, dim=1)
    out = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=1), v32)
    return AttentionOutput(out, lse)


def _stack(parts: list[AttentionOutput], dtype: torch.dtype) -> AttentionOutput:
    return AttentionOutput(
        torch.stack([p.out for p in parts]).to(dtype), torch.stack([p.lse for p in parts])
    )


def paged_decode_reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """Reference for :func:`tierkv.kernels.paged_decode_attention`."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    results = []
    for n in range(q.shape[0]):
        start = int(kv_start[n]) if kv_start is not None else 0
        k, v = gather_kv(pool, layer, block_tables[n], start, int(seq_lens[n]))
        results.append(attend(q[n], k, v, scale))
    return _stack(results, q.dtype)


def cascade_reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    levels: Sequence[ReferenceLevel],
    suffix_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    suffix_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """Reference for :func:`tierkv.kernels.cascade_attention`.

    Concatenates each request's shared levels and its suffix into one context and attends
    over it in a single softmax, so it shares no merge logic with the kernels.
    """
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    results = []
    for n in range(q.shape[0]):
        ks, vs = [], []
        for level in levels:
            g = int(level.group_of_request[n])
            k, v = gather_kv(pool, layer, level.block_table[g], 0, int(level.kv_lens[g]))
            ks.append(k)
            vs.append(v)
        start = int(suffix_start[n]) if suffix_start is not None else 0
        k, v = gather_kv(pool, layer, suffix_tables[n], start, int(suffix_lens[n]))
        ks.append(k)
        vs.append(v)
        results.append(attend(q[n], torch.cat(ks), torch.cat(vs), scale))
    return _stack(results, q.dtype)


def merge_states_reference(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> AttentionOutput:
    """Reference for :func:`tierkv.kernels.merge_states`: combine two softmax parts in fp32."""
    lse = torch.logaddexp(lse_a, lse_b)  # -inf when both are -inf, never NaN
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    out = w_a * out_a.float() + w_b * out_b.float()
    return AttentionOutput(out.to(out_a.dtype), lse)
