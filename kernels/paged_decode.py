"""Paged decode attention: one query token per request against its pages, read in place.

The kernel reads K/V straight out of the store's pool ``[num_slots, num_layers, 2,
block_size, num_kv_heads, head_dim]`` through its strides; there is no per-layer cache to
copy into. One program handles one (request, KV head, split): all ``G = Hq // Hkv`` query
heads of that KV head form the rows of one ``tl.dot``, so a page is loaded once per KV head
rather than once per query head.

Long contexts are split along the KV range (split-K): each split writes a partial output and
its log-sum-exp into an fp32 scratch buffer, and :func:`merge_partials` combines them. With
a single split the kernel writes the final output directly and no merge is launched.

The token range of each request is ``[kv_start, seq_len)``, which is how the cascade's
suffix pass ("the tokens after the shared prefix") reuses this kernel unchanged.
"""
from __future__ import annotations

import math

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

# A plain float global is invisible to compiled kernels (the interpreter does not care).
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def attend_pages(
    q, pool_ptr, row_ptr, s_tb, lo, hi, head_offset, v_offset, scale_log2,
    s_slot, s_tok, s_dim,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Online softmax of query rows ``q [ROWS, BLOCK_D]`` over tokens ``[lo, hi)`` of one
    block table row. Returns the normalised output and the natural-log lse per row."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        slot = tl.load(row_ptr + (t // PAGE) * s_tb, mask=t_ok, other=0)
        # int64 before the multiply: slot * slot_stride passes 2**31 in any real pool.
        k_off = slot.to(tl.int64) * s_slot + head_offset + (t % PAGE) * s_tok
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(pool_ptr + k_off[:, None] + d[None, :] * s_dim, mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + v_offset + k_off[:, None] + d[None, :] * s_dim,
                    mask=kv_mask, other=0.0)
        if DOT_FP32:
            # The interpreter's bf16 dot is wrong; fp32 pools want exact (non-TF32) products.
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_ok[None, :], s * scale_log2, float("-inf"))
        # The body runs only when t0 < hi, so every row sees a finite score: m_new is
        # finite and exp2(m_i - m_new) never meets -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # An empty range leaves l_i = 0: report output 0 and lse -inf instead of 0/0.
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    return out, lse


@triton.jit
def _paged_decode_kernel(
    q_ptr, pool_ptr, table_ptr, start_ptr, end_ptr, out_ptr, lse_ptr,
    layer_offset, v_offset, scale_log2, tokens_per_split,
    s_qn, s_qh, s_qd,
    s_slot, s_tok, s_head, s_dim,
    s_tn, s_tb,
    s_on, s_oh, s_os, s_od,
    s_ln, s_lh, s_ls,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    lo = tl.load(start_ptr + n).to(tl.int32) + split * tokens_per_split
    end = tl.load(end_ptr + n).to(tl.int32)
    # The last split runs to the end, so a low max_kv_len hint costs speed, never tokens.
    hi = tl.where(split == tl.num_programs(2) - 1, end, tl.minimum(lo + tokens_per_split, end))

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    mask = (rows < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + n * s_qn + heads[:, None] * s_qh + d[None, :] * s_qd, mask=mask, other=0.0)
    out, lse = attend_pages(
        q, pool_ptr, table_ptr + n * s_tn, s_tb, lo, hi,
        layer_offset + kv_head.to(tl.int64) * s_head, v_offset, scale_log2, s_slot, s_tok, s_dim,
        PAGE, HEAD_DIM, BLOCK_G, BLOCK_N, BLOCK_D, DOT_FP32,
    )
    tl.store(out_ptr + n * s_on + heads[:, None] * s_oh + split * s_os + d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + n * s_ln + heads * s_lh + split * s_ls, lse, mask=rows < GROUP)


def launch_partials(
    q: torch.Tensor, pool: torch.Tensor, layer: int, tables: torch.Tensor,
    kv_start: torch.Tensor, kv_end: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    tokens_per_split: int, sm_scale: float, tiles: TileConfig,
) -> None:
    """Run the decode kernel writing split ``i`` to ``out[:, :, i]`` / ``lse[:, :, i]``. Internal."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = pool.shape[4]
    group = num_q_heads // num_kv_heads
    grid = (n, num_kv_heads, out.shape[2])
    _paged_decode_kernel[grid](
        q, pool, tables, kv_start, kv_end, out, lse,
        layer * pool.stride(1), pool.stride(2), sm_scale * LOG2E, tokens_per_split,
        *q.stride(), pool.stride(0), pool.stride(3), pool.stride(4), pool.stride(5),
        *tables.stride(), *out.stride(), *lse.stride(),
        GROUP=group, PAGE=pool.shape[3], HEAD_DIM=head_dim,
        BLOCK_G=max(tiles.min_rows, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        BLOCK_D=head_block(head_dim, q.device), DOT_FP32=tiles.dot_fp32 or q.dtype == torch.float32,
        num_warps=tiles.num_warps,
    )


def paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    tiles: TileConfig | None = None,
) -> AttentionOutput:
    """Decode attention of ``q [N, Hq, D]`` over tokens ``[kv_start, seq_lens)`` of each request.

    ``block_tables [N, max_blocks]`` lists each request's slots in token order; entries
    outside the range are never read. ``max_kv_len`` (the largest ``seq_len - kv_start``)
    only sizes split-K (a wrong value costs speed, not correctness); when omitted it is
    computed with one device-to-host sync, which also checks that ranges are ordered and
    fit the table. ``num_splits`` overrides the split
    heuristic. Returns ``AttentionOutput(out [N, Hq, D] in q's dtype, lse [N, Hq] fp32)``.
    Raises :class:`KernelInputError` on malformed inputs.
    """
    check_pool_and_query(q, pool, layer)
    n = q.shape[0]
    if block_tables.dim() != 2:
        raise KernelInputError(f"block_tables must be [N, max_blocks], got {tuple(block_tables.shape)}")
    check_index("block_tables", block_tables, (n, block_tables.shape[1]), q.device)
    check_index("seq_lens", seq_lens, (n,), q.device)
    starts = kv_start if kv_start is not None else torch.zeros_like(seq_lens)
    check_index("kv_start", starts, (n,), q.device)
    if max_kv_len is None:
        max_kv_len = checked_ranges(starts, seq_lens, block_tables.shape[1] * pool.shape[3]).longest
    tiles = for_device(tiles or default_tiles(q.device, q.shape[2], q.dtype), q.device)
    splits, per_split = choose_splits(max_kv_len, n * pool.shape[4], tiles, num_splits)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if n == 0:
        return AttentionOutput(out, lse)
    if splits == 1:
        launch_partials(q, pool, layer, block_tables, starts, seq_lens,
                        out.unsqueeze(2), lse.unsqueeze(2), per_split, scale, tiles)
        return AttentionOutput(out, lse)
    part_out = torch.empty((*q.shape[:2], splits, q.shape[2]), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((*q.shape[:2], splits), dtype=torch.float32, device=q.device)
    launch_partials(q, pool, layer, block_tables, starts, seq_lens, part_out, part_lse, per_split, scale, tiles)
    merge_partials(part_out, part_lse, out, lse)
    return AttentionOutput(out, lse)

