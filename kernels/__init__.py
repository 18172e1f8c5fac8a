"""Triton kernels of tierkv: attention that reads K/V in place from the paged device pool.

Public API (see docs/kernels.md):

* :func:`paged_decode_attention` - one decode token per request over its own pages.
* :func:`plan_cascade` / :func:`cascade_attention` - shared prefixes read once per step.
* :func:`merge_states` - combine two attention parts in fp32.
* :func:`should_use_cascade` / :func:`attention_decode` - the rule for when cascade pays.
* ``reference`` - the PyTorch definitions the kernels are tested against.
"""
from __future__ import annotations

from .base import AttentionOutput, KernelInputError, TileConfig, default_tiles
from .cascade import CascadePlan, LevelPlan, SharedLevel, cascade_attention, plan_cascade
from .merge import merge_states
from .paged_decode import paged_decode_attention
from .policy import (
    CostModel,
    DecodeEstimate,
    attention_decode,
    estimate_decode,
    min_prefix_len,
    plan_pays,
    should_use_cascade,
)

__all__ = [
    "AttentionOutput", "CascadePlan", "CostModel", "DecodeEstimate", "KernelInputError", "LevelPlan",
    "SharedLevel", "TileConfig", "attention_decode", "cascade_attention", "default_tiles",
    "estimate_decode", "merge_states", "min_prefix_len", "paged_decode_attention", "plan_cascade",
    "plan_pays", "should_use_cascade",
]
