"""Paged decode kernel against the PyTorch reference (GPU, or CPU under the interpreter)."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from tierkv.kernels import KernelInputError, TileConfig, merge_states, paged_decode_attention
from tierkv.kernels.reference import merge_states_reference, paged_decode_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 4  # tokens per page: small, so a few dozen tokens span many pages


def _case(make_pool, random_tables, device, dtype, group, lens, num_kv_heads=2, head_dim=16):
    n = len(lens)
    pool = make_pool(24, 2, BLOCK, num_kv_heads, head_dim, dtype)
    tables = random_tables(n, 12, 24)
    q = torch.randn(n, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(3))
    return q.to(device, dtype), pool, tables, torch.tensor(lens, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(make_pool, random_tables, assert_attention_close, device, dtype, group):
    q, pool, tables, lens = _case(make_pool, random_tables, device, dtype, group, [37, 5, 48],
                                  num_kv_heads=2 if group < 8 else 1)
    got = paged_decode_attention(q, pool, 1, tables, lens)
    assert_attention_close(got, paged_decode_reference(q, pool, 1, tables, lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 7])
def test_split_k_with_ragged_last_split(make_pool, random_tables, assert_attention_close, device, dtype, num_splits):
    # 37 and 45 tokens are not multiples of any split size chosen here; 1 token leaves most
    # splits of that request empty (lse -inf), which the merge must ignore.
    q, pool, tables, lens = _case(make_pool, random_tables, device, dtype, 4, [37, 1, 45])
    got = paged_decode_attention(q, pool, 0, tables, lens, num_splits=num_splits)
    assert_attention_close(got, paged_decode_reference(q, pool, 0, tables, lens))


def test_low_max_kv_len_hint_loses_no_tokens(make_pool, random_tables, assert_attention_close, device):
    q, pool, tables, lens = _case(make_pool, random_tables, device, torch.float32, 4, [37, 20])
    tiles = TileConfig(block_n=4, block_m=4, min_rows=1, target_programs=1, min_split_tokens=4, dot_fp32=True)
    got = paged_decode_attention(q, pool, 0, tables, lens, max_kv_len=8, num_splits=2, tiles=tiles)
    assert_attention_close(got, paged_decode_reference(q, pool, 0, tables, lens))


# The GPU's tile shape and dot path (rows padded to 16, fp16 operands, P cast to fp16 before
# P @ V). The interpreter's fp16 dot is right, unlike its bf16 dot, so this runs on CPU too.
GPU_LIKE_TILES = TileConfig(block_n=16, block_m=16, min_rows=16, target_programs=1, min_split_tokens=16,
                            dot_fp32=False)


@pytest.mark.parametrize("group", [1, 8])
def test_native_fp16_dot_path(make_pool, random_tables, assert_attention_close, device, group):
    q, pool, tables, lens = _case(make_pool, random_tables, device, torch.float16, group, [37, 0, 20],
                                  num_kv_heads=1)
    got = paged_decode_attention(q, pool, 1, tables, lens, num_splits=2, tiles=GPU_LIKE_TILES)
    assert_attention_close(got, paged_decode_reference(q, pool, 1, tables, lens))


def test_suffix_range_and_empty_suffix(make_pool, random_tables, assert_attention_close, device):
    q, pool, tables, lens = _case(make_pool, random_tables, device, torch.float32, 4, [30, 9, 0, 20])
    start = torch.tensor([13, 9, 0, 4], device=device)  # request 1 and 2 attend to nothing
    for splits in (None, 3):
        out, lse = paged_decode_attention(q, pool, 1, tables, lens, kv_start=start, num_splits=splits)
        assert_attention_close((out, lse), paged_decode_reference(q, pool, 1, tables, lens, kv_start=start))
        assert torch.all(out[1:3] == 0) and torch.all(lse[1:3] == -math.inf)


def test_one_request_and_int64_tables(make_pool, random_tables, assert_attention_close, device):
    q, pool, _, lens = _case(make_pool, random_tables, device, torch.float16, 1, [17])
    tables = random_tables(1, 12, 24, dtype=torch.int64)
    got = paged_decode_attention(q, pool, 1, tables, lens.to(torch.int32))
    assert_attention_close(got, paged_decode_reference(q, pool, 1, tables, lens))


def test_strided_views_are_read_in_place(make_pool, random_tables, assert_attention_close, device):
    # A pool that is a slice of a bigger one and a q that is a transposed view: the kernel
    # must honour every stride rather than assume contiguity.
    big = make_pool(30, 3, BLOCK, 2, 16, torch.float32)
    pool = big[3:27, 1:]
    q = torch.randn(8, 3, 16, device=device).transpose(0, 1)
    tables = random_tables(3, 12, 24)
    lens = torch.tensor([20, 33, 3], device=device)
    got = paged_decode_attention(q, pool, 1, tables, lens, sm_scale=0.3)
    assert_attention_close(got, paged_decode_reference(q, pool, 1, tables, lens, sm_scale=0.3))


def test_huge_slot_offsets_do_not_wrap(huge_pool, fill_huge_slots, assert_attention_close, device):
    assert (huge_pool.shape[0] - 1) * huge_pool.stride(0) > 2**32
    tables = torch.tensor([[65537, 65543, 3], [65540, 5, 65599]], device=device, dtype=torch.int32)
    fill_huge_slots(huge_pool, tables.flatten().tolist())
    q = torch.randn(2, 8, 32, device=device, dtype=torch.float16)
    lens = torch.tensor([40, 35], device=device)
    got = paged_decode_attention(q, huge_pool, 7, tables, lens)
    assert_attention_close(got, paged_decode_reference(q, huge_pool, 7, tables, lens))


def test_merge_states_guards_empty_parts(assert_attention_close, device):
    gen = torch.Generator().manual_seed(5)
    out_a, out_b = (torch.randn(3, 4, 16, generator=gen).to(device) for _ in range(2))
    lse_a = torch.tensor([[0.5, -math.inf, -math.inf, 2.0]] * 3, device=device)
    lse_b = torch.tensor([[1.0, 3.0, -math.inf, -math.inf]] * 3, device=device)
    out_b[:, 2] = float("nan")  # an empty part's output must not leak into the result
    got = merge_states(out_a, lse_a, out_b, lse_b)
    out_b[:, 2] = 0.0
    assert_attention_close(got, merge_states_reference(out_a, lse_a, out_b, lse_b))
    assert torch.all(got.out[:, 2] == 0) and torch.all(got.lse[:, 2] == -math.inf)
    torch.testing.assert_close(got.out[:, 1], out_b[:, 1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].to(torch.float16)}, "dtype"),
        (lambda a: {**a, "q": a["q"].to(torch.int32)}, "float16, bfloat16 or float32"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of num_kv_heads"),
        (lambda a: {**a, "q": a["q"][..., :8]}, "head_dim"),
        (lambda a: {**a, "q": a["q"].to("meta")}, "is on"),
        (lambda a: {**a, "pool": a["pool"][0]}, "pool must be"),
        (lambda a: {**a, "layer": 2}, "layer 2 out of range"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "int32 or int64"),
        (lambda a: {**a, "block_tables": a["block_tables"][0]}, "block_tables must be"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must have shape"),
        (lambda a: {**a, "seq_lens": a["seq_lens"] + 100}, "does not fit"),
        (lambda a: {**a, "kv_start": a["seq_lens"] + 1}, "start <= end"),
        (lambda a: {**a, "num_splits": 0}, "num_splits"),
    ],
)
def test_rejects_bad_inputs(make_pool, random_tables, device, change, message):
    q, pool, tables, lens = _case(make_pool, random_tables, device, torch.float32, 4, [5, 6])
    args = {"q": q, "pool": pool, "layer": 0, "block_tables": tables, "seq_lens": lens}
    with pytest.raises(KernelInputError, match=message) as info:
        paged_decode_attention(**change(args))
    assert isinstance(info.value, ValueError)


def test_tile_config_validates():
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(block_n=12, block_m=16, min_rows=1, target_programs=1, min_split_tokens=1, dot_fp32=True)


# Compiles every kernel for an H100/H200 (sm_90) down to cubin in a fresh interpreter-free
# process: the interpreter forgives what the compiler rejects (non-constexpr globals,
# loop-carried type changes, dot shapes), so this is the CPU-only guard for the GPU path.
_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tierkv.kernels import cascade, merge, paged_decode

def build(fn, consts, pointers):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*fp32")
        else:
            sig[name] = {"scale_log2": "fp32", "layer_offset": "i64"}.get(name, "i32")
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.metadata.shared <= 160 * 1024, (fn.__name__, kernel.metadata.shared)

shape = dict(PAGE=16, HEAD_DIM=128, BLOCK_D=128, GROUP=4)
for dt, block_n, dot_fp32 in (("bf16", 64, False), ("fp32", 32, True)):
    kv = {"q_ptr": "*" + dt, "pool_ptr": "*" + dt, "table_ptr": "*i32", "end_ptr": "*i64"}
    build(paged_decode._paged_decode_kernel,
          dict(shape, BLOCK_G=16, BLOCK_N=block_n, DOT_FP32=dot_fp32), {**kv, "out_ptr": "*" + dt})
    build(cascade._shared_prefix_kernel, dict(shape, BLOCK_M=64, BLOCK_N=block_n, DOT_FP32=dot_fp32),
          {**kv, "lens_ptr": "*i64", "order_ptr": "*i32", "group_start_ptr": "*i32",
           "tile_group_ptr": "*i32", "tile_row_ptr": "*i32"})
build(merge._merge_partials_kernel, dict(HEAD_DIM=128, BLOCK_P=16, BLOCK_D=128), {"out_ptr": "*bf16"})
build(merge._merge_states_kernel, dict(HEAD_DIM=128, BLOCK_D=128), {"a_ptr": "*bf16", "out_ptr": "*bf16"})
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no nvidia backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], check=False, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_tiles_for_a_gpu_have_every_dot_dimension_at_least_16():
    """Triton's tl.dot on a GPU refuses an operand under 16 along any dimension: interpreter
    sized tiles (as these tests use) and small head dimensions are raised to it there, and
    left alone for the interpreter."""
    from tierkv.kernels.base import for_device, head_block

    small = TileConfig(block_n=4, block_m=4, min_rows=1, target_programs=1, min_split_tokens=4, dot_fp32=True)
    gpu = for_device(small, torch.device("cuda", 0))
    assert (gpu.block_n, gpu.block_m, gpu.min_rows, gpu.min_split_tokens) == (16, 16, 16, 16)
    assert gpu.dot_fp32 and gpu.target_programs == 1
    assert for_device(small, torch.device("cpu")) is small
    assert for_device(GPU_LIKE_TILES, torch.device("cuda", 0)) is GPU_LIKE_TILES
    assert [head_block(d, torch.device("cuda", 0)) for d in (8, 16, 80, 128)] == [16, 16, 128, 128]
    assert [head_block(d, torch.device("cpu")) for d in (1, 8, 80)] == [1, 8, 128]
