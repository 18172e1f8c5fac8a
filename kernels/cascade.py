"""Cascade attention: shared prefix pages read once for every request that shares them.

In batched decode many requests share a prefix (a system prompt, a few-shot block, a
document). The plain paged kernel reads that prefix once per request; here it is read once
per step. The attention of each request is split over disjoint parts of its context:

* one part per *shared level*: a level partitions the N requests into groups, each group
  sharing the first ``kv_lens[g]`` tokens of ``block_table[g]``. Level 0 is typically one
  group (the global system prompt); later levels are per-group blocks (a shared document).
  The prefix kernel stacks the queries of *all* members of a group and, with GQA, all
  ``G = Hq // Hkv`` query heads of a KV head into one block of ``members * G`` rows and
  multiplies it with each K/V tile of the shared pages (``tl.dot``): one page load serves
  every sharer. Groups with more rows than ``block_m`` take several row tiles; those run
  side by side on the same pages (adjacent program ids), so the re-reads mostly hit L2.
* one *suffix* part per request: tokens ``[suffix_start, suffix_lens)`` of its own block
  table, run by the paged decode kernel.

Every part writes ``(out, lse)`` partials into one fp32 buffer, and one merge kernel
combines them (see ``merge.py`` for the guards on empty parts).

What does not depend on the layer (grouping, row tiles, splits) is built once per decode
step by :func:`plan_cascade` and reused for every layer; it copies the small index
tensors to the host once (a few syncs per step, none per layer).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .base import (
    LOG2E,
    AttentionOutput,
    KernelInputError,
    TileConfig,
    check_index,
    check_pool_and_query,
    checked_ranges,
    choose_splits,
    default_tiles,
    for_device,
    head_block,
)
from .merge import merge_partials
from .paged_decode import attend_pages, launch_partials


class SharedLevel(NamedTuple):
    """One level of sharing: request ``n`` attends to the first ``kv_lens[g]`` tokens of
    ``block_table[g]`` where ``g = group_of_request[n]``. A group may have length 0."""

    block_table: torch.Tensor  # [num_groups, max_blocks] int32/int64 slots
    kv_lens: torch.Tensor  # [num_groups] int32/int64
    group_of_request: torch.Tensor  # [N] int32/int64 in [0, num_groups)


@dataclass(frozen=True)
class LevelPlan:
    """A shared level ready to launch: requests sorted by group and cut into row tiles."""

    block_table: torch.Tensor
    kv_lens: torch.Tensor
    order: torch.Tensor  # [N] int32: request ids sorted by group
    group_start: torch.Tensor  # [num_groups + 1] int32: group g is order[start[g]:start[g+1]]
    tile_group: torch.Tensor  # [num_tiles] int32: the group each row tile belongs to
    tile_row: torch.Tensor  # [num_tiles] int32: first row (member * G + head) of the tile
    num_splits: int
    tokens_per_split: int
    shared_tokens: int  # sum of kv_lens over groups with members: tokens read per KV head
    duplicate_tokens: int  # sum of (members - 1) * kv_len: what the plain kernel re-reads


@dataclass(frozen=True)
class CascadePlan:
    """Everything layer-independent about one decode step's cascade; see :func:`plan_cascade`."""

    levels: tuple[LevelPlan, ...]
    suffix_tables: torch.Tensor
    suffix_start: torch.Tensor
    suffix_lens: torch.Tensor
    suffix_splits: int
    suffix_tokens_per_split: int
    suffix_tokens: int  # sum of suffix lengths: tokens the suffix pass reads per KV head
    num_requests: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    tiles: TileConfig

    @property
    def num_parts(self) -> int:
        return sum(level.num_splits for level in self.levels) + self.suffix_splits


def _plan_level(level: SharedLevel, n: int, group: int, block_size: int, tiles: TileConfig,
                num_kv_heads: int, device: torch.device, num_splits: int | None) -> LevelPlan:
    table, lens, owner = level
    if table.dim() != 2:
        raise KernelInputError(f"a level's block_table must be [num_groups, max_blocks], got {tuple(table.shape)}")
    num_groups = table.shape[0]
    check_index("level block_table", table, tuple(table.shape), device)
    check_index("level kv_lens", lens, (num_groups,), device)
    check_index("level group_of_request", owner, (n,), device)
    lens_cpu, owner_cpu = lens.cpu().long(), owner.cpu().long()
    if n and (owner_cpu.min() < 0 or owner_cpu.max() >= num_groups):
        raise KernelInputError(f"group_of_request must lie in [0, {num_groups})")
    longest = checked_ranges(torch.zeros_like(lens_cpu), lens_cpu, table.shape[1] * block_size).longest
    members = torch.bincount(owner_cpu, minlength=num_groups)
    group_start = torch.zeros(num_groups + 1, dtype=torch.int64)
    group_start[1:] = torch.cumsum(members, 0)
    tile_group, tile_row = [], []
    for g, count in enumerate(members.tolist()):
        for row in range(0, count * group, tiles.block_m):
            tile_group.append(g)
            tile_row.append(row)
    splits, per_split = choose_splits(longest, len(tile_group) * num_kv_heads, tiles, num_splits)
    used = members > 0

    def on_device(values: torch.Tensor | list[int]) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    return LevelPlan(
        block_table=table, kv_lens=lens,
        order=on_device(torch.argsort(owner_cpu, stable=True)), group_start=on_device(group_start),
        tile_group=on_device(tile_group), tile_row=on_device(tile_row),
        num_splits=splits, tokens_per_split=per_split,
        shared_tokens=int(lens_cpu[used].sum()),
        duplicate_tokens=int(((members - 1).clamp(min=0) * lens_cpu).sum()),
    )


def plan_cascade(
    pool: torch.Tensor,
    num_q_heads: int,
    levels: Sequence[SharedLevel],
    suffix_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    *,
    suffix_start: torch.Tensor | None = None,
    tiles: TileConfig | None = None,
    num_splits: int | None = None,
) -> CascadePlan:
    """Build the layer-independent plan of one decode step (syncs with the device).

    ``levels`` are the shared parts (may be empty: then this is plain paged decode).
    ``suffix_tables [N, max_blocks]`` / ``suffix_start`` / ``suffix_lens [N]`` give each
    request's own tokens ``[suffix_start, suffix_lens)``; a length-0 suffix is allowed.
    ``num_splits`` forces the split count of every part (tests). All tensors must be on the
    pool's device. Raises :class:`KernelInputError` on malformed inputs.
    """
    if pool.dim() != 6:
        raise KernelInputError(f"pool must be 6-D, got {tuple(pool.shape)}")
    num_kv_heads, block_size, device = pool.shape[4], pool.shape[3], pool.device
    if num_q_heads % num_kv_heads:
        raise KernelInputError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if suffix_tables.dim() != 2:
        raise KernelInputError(f"suffix_tables must be [N, max_blocks], got {tuple(suffix_tables.shape)}")
    n = suffix_tables.shape[0]
    check_index("suffix_tables", suffix_tables, tuple(suffix_tables.shape), device)
    check_index("suffix_lens", suffix_lens, (n,), device)
    start = suffix_start if suffix_start is not None else torch.zeros_like(suffix_lens)
    check_index("suffix_start", start, (n,), device)
    tiles = for_device(tiles or default_tiles(device, pool.shape[5], pool.dtype), device)
    group = num_q_heads // num_kv_heads
    level_plans = tuple(
        _plan_level(level, n, group, block_size, tiles, num_kv_heads, device, num_splits) for level in levels
    )
    stats = checked_ranges(start, suffix_lens, suffix_tables.shape[1] * block_size)
    splits, per_split = choose_splits(stats.longest, n * num_kv_heads, tiles, num_splits)
    return CascadePlan(
        levels=level_plans, suffix_tables=suffix_tables, suffix_start=start, suffix_lens=suffix_lens,
        suffix_splits=splits, suffix_tokens_per_split=per_split, suffix_tokens=stats.total,
        num_requests=n, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        block_size=block_size, tiles=tiles,
    )


@triton.jit
def _shared_prefix_kernel(
    q_ptr, pool_ptr, table_ptr, lens_ptr, order_ptr, group_start_ptr, tile_group_ptr, tile_row_ptr,
    out_ptr, lse_ptr,
    layer_offset, v_offset, scale_log2, tokens_per_split,
    s_qn, s_qh, s_qd,
    s_slot, s_tok, s_head, s_dim,
    s_tg, s_tb,
    s_on, s_oh, s_os, s_od,
    s_ln, s_lh, s_ls,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Row tiles vary fastest so the tiles of one group that read the same pages run together.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.load(tile_group_ptr + tile).to(tl.int64)
    first = tl.load(group_start_ptr + g)
    num_rows = (tl.load(group_start_ptr + g + 1) - first) * GROUP
    r = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
    r_ok = r < num_rows
    # Row r of the group is query head (r % GROUP) of its (r // GROUP)-th member.
    req = tl.load(order_ptr + first + r // GROUP, mask=r_ok, other=0).to(tl.int64)
    heads = kv_head * GROUP + r % GROUP
    lo = split * tokens_per_split
    end = tl.load(lens_ptr + g).to(tl.int32)
    hi = tl.where(split == tl.num_programs(2) - 1, end, tl.minimum(lo + tokens_per_split, end))

    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + req[:, None] * s_qn + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=mask, other=0.0)
    out, lse = attend_pages(
        q, pool_ptr, table_ptr + g * s_tg, s_tb, lo, hi,
        layer_offset + kv_head.to(tl.int64) * s_head, v_offset, scale_log2, s_slot, s_tok, s_dim,
        PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, DOT_FP32,
    )
    tl.store(out_ptr + req[:, None] * s_on + heads[:, None] * s_oh + split * s_os + d[None, :] * s_od,
             out, mask=mask)
    tl.store(lse_ptr + req * s_ln + heads * s_lh + split * s_ls, lse, mask=r_ok)


def _launch_level(q: torch.Tensor, pool: torch.Tensor, layer: int, level: LevelPlan,
                  part_out: torch.Tensor, part_lse: torch.Tensor, scale: float, tiles: TileConfig) -> None:
    num_kv_heads, head_dim = pool.shape[4], q.shape[2]
    if level.tile_group.shape[0] == 0:
        return
    grid = (level.tile_group.shape[0], num_kv_heads, level.num_splits)
    _shared_prefix_kernel[grid](
        q, pool, level.block_table, level.kv_lens, level.order, level.group_start,
        level.tile_group, level.tile_row, part_out, part_lse,
        layer * pool.stride(1), pool.stride(2), scale * LOG2E, level.tokens_per_split,
        *q.stride(), pool.stride(0), pool.stride(3), pool.stride(4), pool.stride(5),
        *level.block_table.stride(), *part_out.stride(), *part_lse.stride(),
        GROUP=q.shape[1] // num_kv_heads, PAGE=pool.shape[3], HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=head_block(head_dim, q.device), DOT_FP32=tiles.dot_fp32 or q.dtype == torch.float32,
        num_warps=tiles.num_warps,
    )


def cascade_attention(
    q: torch.Tensor, pool: torch.Tensor, layer: int, plan: CascadePlan, *, sm_scale: float | None = None
) -> AttentionOutput:
    """Decode attention of ``q [N, Hq, D]`` over each request's shared levels and suffix.

    Launches one prefix kernel per level, one suffix kernel and one merge; K/V are read in
    place from ``pool[:, layer]``. Returns ``AttentionOutput(out [N, Hq, D] in q's dtype,
    lse [N, Hq] fp32)``. Raises :class:`KernelInputError` if ``q``/``pool`` do not match the plan.
    """
    check_pool_and_query(q, pool, layer)
    expected = (plan.num_requests, plan.num_q_heads)
    if tuple(q.shape[:2]) != expected:
        raise KernelInputError(f"q is [N, Hq] = {tuple(q.shape[:2])} but the plan was built for {expected}")
    if pool.shape[4] != plan.num_kv_heads or pool.shape[3] != plan.block_size:
        raise KernelInputError("the pool's block_size or num_kv_heads differs from the plan's")
    if plan.suffix_tables.device != q.device:
        raise KernelInputError(f"the plan is on {plan.suffix_tables.device} but q is on {q.device}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if q.shape[0] == 0:
        return AttentionOutput(out, lse)
    shape = (*q.shape[:2], plan.num_parts)
    part_out = torch.empty((*shape, q.shape[2]), dtype=torch.float32, device=q.device)
    part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    first = 0
    for level in plan.levels:
        parts = slice(first, first + level.num_splits)
        _launch_level(q, pool, layer, level, part_out[:, :, parts], part_lse[:, :, parts], scale, plan.tiles)
        first += level.num_splits
    launch_partials(
        q, pool, layer, plan.suffix_tables, plan.suffix_start, plan.suffix_lens,
        part_out[:, :, first:], part_lse[:, :, first:], plan.suffix_tokens_per_split, scale, plan.tiles,
    )
    merge_partials(part_out, part_lse, out, lse)
    return AttentionOutput(out, lse)
