"""When cascade attention pays, and a decode entry point that follows the rule.

Decode attention is memory bound, so the rule is a byte-count model plus a fixed cost per
kernel launch (see docs/kernels.md for the derivation and the resulting thresholds):

* plain paged decode reads every request's whole context: the shared prefix once *per
  sharer*; with few (request, KV head) programs it also splits the KV range and pays the
  fp32 partials and a merge launch;
* cascade reads each shared prefix once per step, plus the fp32 partials of every part
  (written once, read once by the merge), plus the queries once per pass, and launches
  ``levels + 2`` kernels.

The constants model an H200: ``bandwidth`` and ``launch_s`` from its datasheet class,
``cascade_bandwidth`` fitted to ``scripts/bench_cascade.py`` on one (docs/kernels.md: the
cascade kernels reach about half the bytes/s of the plain one, so the model without it
chose cascade on shapes where plain was measured faster).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .base import AttentionOutput, TileConfig, cdiv, choose_splits
from .cascade import CascadePlan, cascade_attention
from .paged_decode import paged_decode_attention


@dataclass(frozen=True)
class CostModel:
    """Machine constants of the rule. Defaults model an H200 (132 SMs, HBM3e)."""

    bandwidth: float = 4.0e12  # bytes/s a streaming kernel reaches (about 85% of the 4.8 TB/s peak)
    launch_s: float = 3.0e-6  # launch plus ramp-up/tail of one extra small kernel in a stream
    # What the cascade's passes stream at, measured: 2026-12-04 on an H200, from CUDA-graph
    # times of 10 shapes (docs/performance.md), the fit that makes the rule pick the faster
    # method on each; the plain kernel meets ``bandwidth`` (above it, from L2 reuse).
    cascade_bandwidth: float = 2.0e12
    margin: float = 1.1  # cascade must beat plain by this factor, so model error does not flip the choice
    num_sms: int = 132
    block_m: int = 64  # rows per prefix program, as in default_tiles() on a GPU
    min_split_tokens: int = 256

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.cascade_bandwidth <= 0 or self.launch_s < 0 or self.margin < 1 or self.num_sms < 1 or self.block_m < 1:
            raise ValueError("CostModel needs bandwidths > 0, launch_s >= 0, margin >= 1, num_sms >= 1, block_m >= 1")

    def tiles(self) -> TileConfig:
        return TileConfig(block_n=64, block_m=self.block_m, min_rows=16, target_programs=2 * self.num_sms,
                          min_split_tokens=self.min_split_tokens, dot_fp32=False)


class DecodeEstimate(NamedTuple):
    """Bytes each method moves per layer and step, and the modelled times."""

    plain_bytes: int
    cascade_bytes: int
    plain_s: float
    cascade_s: float


def _partial_bytes(num_requests: int, num_q_heads: int, head_dim: int, parts: int) -> int:
    # fp32 out + fp32 lse per (request, head, part), written by a pass and read by the merge.
    return 2 * num_requests * num_q_heads * parts * (head_dim + 1) * 4


def estimate_decode(
    *,
    num_requests: int,
    context_tokens: int,
    duplicate_tokens: int,
    longest_context: int,
    prefix_parts: int,
    suffix_parts: int,
    num_levels: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    model: CostModel,
) -> DecodeEstimate:
    """Model one layer of one decode step both ways.

    ``context_tokens`` is the sum of every request's full context (what plain reads);
    ``duplicate_tokens`` is how many of those cascade does not read (``sum (members - 1) *
    shared_len`` over groups); ``prefix_parts``/``suffix_parts`` are the cascade's splits.
    """
    per_token = 2 * num_kv_heads * head_dim * dtype_bytes  # K and V of one token, one layer
    q_and_out = 2 * num_requests * num_q_heads * head_dim * dtype_bytes
    plain_parts, _ = choose_splits(longest_context, num_requests * num_kv_heads, model.tiles())
    plain_bytes = context_tokens * per_token + q_and_out
    plain_launches = 1
    if plain_parts > 1:
        plain_bytes += _partial_bytes(num_requests, num_q_heads, head_dim, plain_parts)
        plain_launches = 2
    q_reads = num_levels * num_requests * num_q_heads * head_dim * dtype_bytes  # q again per level
    cascade_bytes = (
        (context_tokens - duplicate_tokens) * per_token + q_and_out + q_reads
        + _partial_bytes(num_requests, num_q_heads, head_dim, prefix_parts + suffix_parts)
    )
    cascade_launches = num_levels + 2  # one per level, the suffix pass, the merge
    return DecodeEstimate(
        plain_bytes=plain_bytes, cascade_bytes=cascade_bytes,
        plain_s=plain_bytes / model.bandwidth + plain_launches * model.launch_s,
        cascade_s=cascade_bytes / model.cascade_bandwidth + cascade_launches * model.launch_s,
    )


def should_use_cascade(
    num_sharers: int,
    prefix_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    suffix_len: int = 0,
    head_dim: int = 128,
    dtype_bytes: int = 2,
    model: CostModel = CostModel(),
) -> bool:
    """True when one shared level of ``prefix_len`` tokens over ``num_sharers`` requests
    (each with ``suffix_len`` tokens of its own) is modelled faster with cascade."""
    if num_sharers < 2 or prefix_len <= 0:
        return False  # nothing is read twice: cascade only adds passes
    rows = num_sharers * (num_q_heads // num_kv_heads)
    prefix_parts, _ = choose_splits(prefix_len, cdiv(rows, model.block_m) * num_kv_heads, model.tiles())
    suffix_parts, _ = choose_splits(suffix_len, num_sharers * num_kv_heads, model.tiles())
    est = estimate_decode(
        num_requests=num_sharers, context_tokens=num_sharers * (prefix_len + suffix_len),
        duplicate_tokens=(num_sharers - 1) * prefix_len, longest_context=prefix_len + suffix_len,
        prefix_parts=prefix_parts, suffix_parts=suffix_parts, num_levels=1,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype_bytes=dtype_bytes, model=model,
    )
    return est.cascade_s * model.margin < est.plain_s


def min_prefix_len(num_sharers: int, num_q_heads: int, num_kv_heads: int, *, head_dim: int = 128,
                   dtype_bytes: int = 2, model: CostModel = CostModel(), limit: int = 1 << 20) -> int | None:
    """Smallest prefix length at which :func:`should_use_cascade` says yes (suffix 0), or
    None below ``limit``. Used to print the threshold table in docs/kernels.md."""
    lo, hi = 1, limit
    if not should_use_cascade(num_sharers, hi, num_q_heads, num_kv_heads, head_dim=head_dim,
                              dtype_bytes=dtype_bytes, model=model):
        return None
    while lo < hi:  # the benefit grows with prefix_len, so bisect
        mid = (lo + hi) // 2
        if should_use_cascade(num_sharers, mid, num_q_heads, num_kv_heads, head_dim=head_dim,
                              dtype_bytes=dtype_bytes, model=model):
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_pays(plan: CascadePlan, head_dim: int, dtype_bytes: int, model: CostModel = CostModel()) -> bool:
    """The rule applied to a built (possibly multi-level) plan, with its real split counts."""
    duplicate = sum(level.duplicate_tokens for level in plan.levels)
    if duplicate == 0:
        return False
    shared = sum(level.shared_tokens for level in plan.levels)
    prefix_parts = sum(level.num_splits for level in plan.levels)
    n = plan.num_requests
    # Per-request prefix length is not kept in the plan; the average is close enough for
    # the split estimate of the plain kernel, which is the only use of longest_context.
    longest = math.ceil((shared + duplicate + plan.suffix_tokens) / max(n, 1))
    est = estimate_decode(
        num_requests=n, context_tokens=shared + duplicate + plan.suffix_tokens,
        duplicate_tokens=duplicate, longest_context=longest,
        prefix_parts=prefix_parts, suffix_parts=plan.suffix_splits, num_levels=len(plan.levels),
        num_q_heads=plan.num_q_heads, num_kv_heads=plan.num_kv_heads, head_dim=head_dim,
        dtype_bytes=dtype_bytes, model=model,
    )
    return est.cascade_s * model.margin < est.plain_s


def attention_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cascade: CascadePlan | None = None,
    sm_scale: float | None = None,
    max_kv_len: int | None = None,
    model: CostModel = CostModel(),
) -> AttentionOutput:
    """Decode attention that takes the cascade path when ``cascade`` is given and pays.

    ``block_tables [N, max_blocks]`` / ``seq_lens [N]`` are each request's *full* context
    (used by the plain path); ``cascade`` describes the same context split into shared
    levels and suffixes (see :func:`tierkv.kernels.plan_cascade`). Both paths compute the
    same attention; only their speed differs.
    """
    if cascade is not None and plan_pays(cascade, q.shape[-1], q.element_size(), model):
        return cascade_attention(q, pool, layer, cascade, sm_scale=sm_scale)
    return paged_decode_attention(q, pool, layer, block_tables, seq_lens, sm_scale=sm_scale, max_kv_len=max_kv_len)
