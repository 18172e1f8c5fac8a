"""Cascade attention (shared levels + suffix + merge) against the PyTorch reference."""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from tierkv.kernels import (
    CostModel,
    KernelInputError,
    SharedLevel,
    TileConfig,
    attention_decode,
    cascade,
    min_prefix_len,
    plan_cascade,
    policy,
    should_use_cascade,
)
from tierkv.kernels.reference import ReferenceLevel, cascade_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 4
SLOTS = 48
# block_m = 4 rows: with G = 4 each request is its own row tile, so the multi-tile path runs.
SMALL_TILES = TileConfig(block_n=8, block_m=4, min_rows=1, target_programs=1, min_split_tokens=8, dot_fp32=True)


def _levels(device, n, two_levels=True):
    """Level 0: one group (a system prompt of 21 tokens, 6 pages with the last one ragged).
    Level 1: two groups alternating over the requests, one of them empty."""
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(SLOTS, generator=gen).to(device)
    levels = [SharedLevel(slots[:6].view(1, 6), torch.tensor([21], device=device),
                          torch.zeros(n, dtype=torch.int64, device=device))]
    if two_levels:
        levels.append(SharedLevel(slots[6:12].view(2, 3).to(torch.int32), torch.tensor([9, 0], device=device),
                                  (torch.arange(n, device=device) % 2).to(torch.int32)))
    suffix = slots[12:12 + 4 * n].view(n, 4)
    return levels, suffix


def _run(make_pool, device, dtype, group, suffix_lens, *, two_levels=True, tiles=SMALL_TILES, num_splits=None,
         suffix_start=None, num_kv_heads=2):
    n = len(suffix_lens)
    pool = make_pool(SLOTS, 2, BLOCK, num_kv_heads, 16, dtype)
    q = torch.randn(n, num_kv_heads * group, 16, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    levels, suffix = _levels(device, n, two_levels)
    lens = torch.tensor(suffix_lens, device=device)
    plan = plan_cascade(pool, q.shape[1], levels, suffix, lens, suffix_start=suffix_start, tiles=tiles,
                        num_splits=num_splits)
    got = cascade.cascade_attention(q, pool, 1, plan)
    want = cascade_reference(q, pool, 1, [ReferenceLevel(*lv) for lv in levels], suffix, lens, suffix_start)
    return got, want, plan


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_two_levels_match_reference(make_pool, assert_attention_close, device, dtype, group):
    got, want, plan = _run(make_pool, device, dtype, group, [5, 0, 16], num_kv_heads=2 if group < 8 else 1)
    assert len(plan.levels) == 2
    assert_attention_close(got, want)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_prefix_not_a_multiple_of_the_split(make_pool, assert_attention_close, device, num_splits):
    # 21 shared tokens in splits of 8 (ragged last split); 9 tokens at level 1.
    got, want, plan = _run(make_pool, device, torch.float16, 4, [7, 3], num_splits=num_splits)
    assert plan.levels[0].num_splits * plan.levels[0].tokens_per_split >= 21
    assert_attention_close(got, want)


def test_default_tiles_and_one_request(make_pool, assert_attention_close, device):
    got, want, _ = _run(make_pool, device, torch.bfloat16, 4, [6], tiles=None)
    assert_attention_close(got, want)


def test_native_fp16_dot_path(make_pool, assert_attention_close, device):
    gpu_like = TileConfig(block_n=16, block_m=16, min_rows=16, target_programs=1, min_split_tokens=16,
                          dot_fp32=False)
    got, want, _ = _run(make_pool, device, torch.float16, 4, [5, 0, 16], tiles=gpu_like)
    assert_attention_close(got, want)


def test_all_suffixes_empty_and_suffix_ranges(make_pool, assert_attention_close, device):
    got, want, _ = _run(make_pool, device, torch.float32, 4, [0, 0, 0])
    assert_attention_close(got, want)
    start = torch.tensor([2, 16, 0], device=device)  # the middle request's suffix is empty
    got, want, _ = _run(make_pool, device, torch.float32, 4, [9, 16, 5], suffix_start=start)
    assert_attention_close(got, want)


def test_no_shared_prefix(make_pool, assert_attention_close, device):
    # No levels at all: the cascade degenerates to the suffix pass plus a merge.
    n, pool = 3, make_pool(SLOTS, 2, BLOCK, 2, 16, torch.float32)
    q = torch.randn(n, 8, 16, device=device)
    _, suffix = _levels(device, n)
    lens = torch.tensor([13, 0, 16], device=device)
    plan = plan_cascade(pool, 8, [], suffix, lens, tiles=SMALL_TILES)
    assert_attention_close(cascade.cascade_attention(q, pool, 0, plan),
                           cascade_reference(q, pool, 0, [], suffix, lens))


def test_nothing_at_all_gives_zero_and_minus_inf(make_pool, device):
    pool = make_pool(SLOTS, 1, BLOCK, 2, 16, torch.float16)
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int32, device=device)

    level = SharedLevel(zeros(1, 1), zeros(1), zeros(2))
    plan = plan_cascade(pool, 4, [level], zeros(2, 1), zeros(2), tiles=SMALL_TILES)
    out, lse = cascade.cascade_attention(torch.randn(2, 4, 16, device=device, dtype=torch.float16), pool, 0, plan)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_prefix_is_read_once_per_kv_head(make_pool, device):
    """One launch per level, and for a group whose N * G rows fit one tile, one row tile:
    every (KV head, prefix page) is loaded by exactly one program (per split)."""
    n, group = 4, 4
    tiles = TileConfig(block_n=8, block_m=16, min_rows=1, target_programs=1, min_split_tokens=8, dot_fp32=True)
    pool = make_pool(SLOTS, 2, BLOCK, 2, 16, torch.float32)
    levels, suffix = _levels(device, n, two_levels=False)
    plan = plan_cascade(pool, 2 * group, levels, suffix, torch.full((n,), 5, device=device), tiles=tiles)
    launches = []
    real = cascade._shared_prefix_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, args[2]))
                return real[grid](*args, **kwargs)
            return launch

    with mock.patch.object(cascade, "_shared_prefix_kernel", Recorder()):
        cascade.cascade_attention(torch.randn(n, 2 * group, 16, device=device), pool, 0, plan)
    assert len(launches) == 1
    (tiles_dim, kv_heads, splits), table = launches[0]
    assert (tiles_dim, kv_heads) == (1, 2) and splits == plan.levels[0].num_splits
    assert table is levels[0].block_table  # the one shared copy, not a per-request gather


def test_huge_slot_offsets_in_prefix_pass(huge_pool, fill_huge_slots, assert_attention_close, device):
    prefix = torch.tensor([[65599, 65538, 2]], device=device, dtype=torch.int32)
    suffix = torch.tensor([[65541, 65590], [9, 65555]], device=device, dtype=torch.int32)
    fill_huge_slots(huge_pool, prefix.flatten().tolist() + suffix.flatten().tolist())
    level = SharedLevel(prefix, torch.tensor([45], device=device), torch.zeros(2, dtype=torch.int64, device=device))
    lens = torch.tensor([20, 32], device=device)
    q = torch.randn(2, 32, 32, device=device, dtype=torch.float16)
    plan = plan_cascade(huge_pool, 32, [level], suffix, lens, tiles=SMALL_TILES)
    assert_attention_close(cascade.cascade_attention(q, huge_pool, 6, plan),
                           cascade_reference(q, huge_pool, 6, [ReferenceLevel(*level)], suffix, lens))


def test_plan_rejects_bad_levels(make_pool, device):
    pool = make_pool(SLOTS, 1, BLOCK, 2, 16, torch.float32)
    levels, suffix = _levels(device, 2)
    lens = torch.tensor([1, 2], device=device)
    bad_group = SharedLevel(levels[1].block_table, levels[1].kv_lens, torch.tensor([0, 2], device=device))
    with pytest.raises(KernelInputError, match="group_of_request must lie"):
        plan_cascade(pool, 8, [bad_group], suffix, lens)
    too_long = SharedLevel(levels[1].block_table, torch.tensor([13, 0], device=device), levels[1].group_of_request)
    with pytest.raises(KernelInputError, match="does not fit"):
        plan_cascade(pool, 8, [too_long], suffix, lens)
    with pytest.raises(KernelInputError, match="multiple of num_kv_heads"):
        plan_cascade(pool, 7, levels, suffix, lens)
    plan = plan_cascade(pool, 8, levels, suffix, lens)
    with pytest.raises(KernelInputError, match="plan was built for"):
        cascade.cascade_attention(torch.randn(3, 8, 16, device=device), pool, 0, plan)


def test_rule_thresholds_follow_the_byte_model():
    assert not should_use_cascade(1, 100_000, 32, 8)  # nothing is read twice
    assert not should_use_cascade(64, 0, 32, 8)
    assert should_use_cascade(64, 8192, 32, 8, suffix_len=256)  # shape A of the benchmark
    # Shape C: plain measured faster on an H200 (32.5 against 38.3 us, CUDA graphs), which
    # the model gets right only with the cascade's measured bandwidth (CostModel).
    assert not should_use_cascade(16, 1024, 32, 8, suffix_len=1024)
    assert should_use_cascade(16, 1024, 32, 8, suffix_len=1024, model=CostModel(cascade_bandwidth=4.0e12))
    assert should_use_cascade(8, 8192, 32, 8, suffix_len=256)  # N8: cascade measured 2x faster
    assert not should_use_cascade(2, 256, 32, 8)  # a short prefix does not pay for two launches
    assert min_prefix_len(2, 32, 8) is None  # two sharers save at most half, at half the bandwidth
    thresholds = [min_prefix_len(n, 32, 8) for n in (4, 8, 64)]
    assert all(t is not None for t in thresholds) and thresholds == sorted(thresholds, reverse=True)
    slow_launch = CostModel(launch_s=20e-6)
    assert min_prefix_len(8, 32, 8, model=slow_launch) > thresholds[1]


def test_attention_decode_picks_by_the_rule(make_pool, assert_attention_close, device):
    n = 4
    pool = make_pool(SLOTS, 2, BLOCK, 2, 16, torch.float32)
    q = torch.randn(n, 8, 16, device=device)
    levels, suffix = _levels(device, n, two_levels=False)
    suffix_lens = torch.tensor([3, 0, 4, 2], device=device)
    plan = plan_cascade(pool, 8, levels, suffix, suffix_lens, tiles=SMALL_TILES)
    # The same context as full block tables: 21 shared tokens then the suffix, which
    # starts on a fresh page (token 24) because the shared level owns its ragged last page.
    full = torch.cat([levels[0].block_table.expand(n, -1), suffix], dim=1)
    starts = torch.full((n,), 24, device=device)
    want = cascade_reference(q, pool, 1, [ReferenceLevel(*levels[0])], suffix, suffix_lens)
    for launch_s, expect_cascade in ((0.0, True), (1.0, False)):
        model = CostModel(launch_s=launch_s, cascade_bandwidth=CostModel().bandwidth)
        with mock.patch.object(policy, "cascade_attention", wraps=policy.cascade_attention) as spy:
            if expect_cascade:
                got = attention_decode(q, pool, 1, full, starts + suffix_lens, cascade=plan, model=model)
                assert_attention_close(got, want)
            else:
                attention_decode(q, pool, 1, full, starts + suffix_lens, cascade=plan, model=model)
        assert spy.called == expect_cascade
