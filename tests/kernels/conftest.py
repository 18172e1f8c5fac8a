"""Kernel tests run on the GPU when there is one, else under the Triton interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` wraps the kernels, i.e. before
``tierkv.kernels`` is first imported, which is why this happens at conftest import time.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from triton_interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (out atol, lse atol) per dtype. Scores and the softmax are fp32 everywhere; the output
# error is the rounding of the final cast (bf16 has 8 mantissa bits: ~4e-3 relative) plus,
# on a GPU, P cast to the KV dtype before the P @ V product.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


def _make_pool(
    num_slots: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, seed: int = 0,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_slots, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen)
    return pool.to(DEVICE, dtype)


def _random_tables(num_rows: int, max_blocks: int, num_slots: int, seed: int = 1,
                  dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Distinct slots per row, in random order, as a real block table would be."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_slots, generator=gen)[:max_blocks] for _ in range(num_rows)]
    return torch.stack(rows).to(DEVICE, dtype)


Pair = tuple[torch.Tensor, torch.Tensor]


def _assert_attention_close(actual: Pair, expected: Pair) -> None:
    out, lse = actual
    ref_out, ref_lse = expected
    atol_out, atol_lse = TOLERANCES[out.dtype]
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol_out, rtol=atol_out)
    torch.testing.assert_close(lse, ref_lse, atol=atol_lse, rtol=atol_lse)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


# Helpers are handed out as fixtures: tests/conftest.py is also a module named "conftest",
# so importing from this one by name would be ambiguous.
@pytest.fixture
def make_pool() -> Callable[..., torch.Tensor]:
    return _make_pool


@pytest.fixture
def random_tables() -> Callable[..., torch.Tensor]:
    return _random_tables


@pytest.fixture
def assert_attention_close() -> Callable[..., None]:
    return _assert_attention_close


# A pool whose slot stride (65536 elements) times a slot index passes 2**32, so int32
# offset arithmetic wraps to a *valid* low slot (slot 65536 + k wraps to slot k) and reads
# wrong data instead of faulting. On the CPU it is a sparse file mapped into memory: 8.6 GB
# of address space, only the touched slots become real pages.
HUGE_SHAPE = (65536 + 64, 8, 2, 16, 8, 32)


@pytest.fixture
def huge_pool(tmp_path: Path) -> torch.Tensor:
    numel = 1
    for dim in HUGE_SHAPE:
        numel *= dim
    if DEVICE.type == "cuda":
        return torch.empty(HUGE_SHAPE, dtype=torch.float16, device=DEVICE)
    path = tmp_path / "huge_pool.bin"
    with open(path, "wb") as f:
        f.truncate(numel * 2)
    flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float16)
    return flat.view(HUGE_SHAPE)


def fill_slots(pool: torch.Tensor, slots: list[int], seed: int = 2) -> None:
    """Random data in ``slots`` and in the low slots their offsets would wrap to in int32."""
    gen = torch.Generator().manual_seed(seed)
    wrapped = [(s * pool.stride(0) % 2**32) // pool.stride(0) for s in slots]
    for slot in sorted(set(slots) | set(wrapped)):
        pool[slot] = torch.randn(pool.shape[1:], generator=gen).to(pool.dtype)


@pytest.fixture
def fill_huge_slots() -> Callable[[torch.Tensor, list[int]], None]:
    return fill_slots

