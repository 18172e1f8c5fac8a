"""What the kernel modules share: result type, input error, tile sizes and input checks.

Kept free of Triton so the PyTorch references and the cost model import without it.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import TierKVError

LOG2E = 1.4426950408889634
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AttentionOutput(NamedTuple):
    """What every attention function in ``tierkv.kernels`` returns."""

    out: torch.Tensor  # [N, Hq, D] in the query's dtype
    lse: torch.Tensor  # [N, Hq] fp32, natural log; -inf where nothing was attended


class KernelInputError(TierKVError, ValueError):
    """A kernel wrapper got tensors it cannot run on (shape, dtype, stride or device)."""

    default_hint = "see docs/kernels.md for the shapes and dtypes each kernel accepts"


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch targets shared by the decode and cascade kernels."""

    block_n: int  # KV tokens per inner-loop step
    block_m: int  # query rows per cascade prefix program
    min_rows: int  # tl.dot needs >= 16 rows on a GPU; the interpreter takes any
    target_programs: int  # split-K aims for about this many programs per launch
    min_split_tokens: int  # a split shorter than this costs more in merge than it gains
    dot_fp32: bool  # multiply in fp32: the interpreter's bf16 tl.dot gives wrong results
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m", "min_rows"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two, got {value}")
        if self.block_m < self.min_rows:
            raise ValueError(f"TileConfig.block_m ({self.block_m}) must be >= min_rows ({self.min_rows})")
        if self.target_programs < 1 or self.min_split_tokens < 1:
            raise ValueError("TileConfig.target_programs and min_split_tokens must be >= 1")


@functools.cache
def default_tiles(device: torch.device, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """Tiles for ``device``: GPU sizes for bandwidth, tiny ones for the CPU interpreter."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        # Rows of 256 bytes keep a K and a V tile at 16 KiB each, so the pipelined loads
        # fit shared memory on any recent GPU; wider rows (fp32, head_dim 256) halve block_n.
        row_bytes = head_dim * torch.empty((), dtype=dtype).element_size()
        return TileConfig(block_n=64 if row_bytes <= 256 else 32, block_m=64, min_rows=16,
                          target_programs=2 * sms, min_split_tokens=256, dot_fp32=False)
    return TileConfig(block_n=16, block_m=16, min_rows=1, target_programs=1,
                      min_split_tokens=16, dot_fp32=True)


# A GPU's tl.dot takes operands of at least 16 along each dimension (Triton asserts it at
# compile time); the interpreter takes any.
GPU_MIN_DOT = 16


def for_device(tiles: TileConfig, device: torch.device) -> TileConfig:
    """``tiles`` as a launch on ``device`` can use them: on a GPU every dot dimension at least
    GPU_MIN_DOT (a TileConfig made for the interpreter, as the tests' small ones, then
    still runs there; tokens per split stay multiples of ``block_n``)."""
    if device.type != "cuda":
        return tiles
    low = GPU_MIN_DOT
    if min(tiles.block_n, tiles.block_m, tiles.min_rows) >= low:
        return tiles
    return dataclasses.replace(tiles, block_n=max(tiles.block_n, low), block_m=max(tiles.block_m, low),
                               min_rows=max(tiles.min_rows, low), min_split_tokens=max(tiles.min_split_tokens, low))


def head_block(head_dim: int, device: torch.device) -> int:
    """The head dimension's tile: its next power of two, at least GPU_MIN_DOT on a GPU (the
    padding is masked: those lanes load zeros)."""
    block = 1 << max(0, head_dim - 1).bit_length()
    return max(block, GPU_MIN_DOT) if device.type == "cuda" else block


def choose_splits(max_len: int, programs_per_split: int, tiles: TileConfig,
                  num_splits: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split) for a KV range of ``max_len``; tokens per split is a
    multiple of ``block_n`` so only the last split of a request has a ragged tail."""
    if num_splits is None:
        wanted = cdiv(tiles.target_programs, max(programs_per_split, 1))
        useful = cdiv(max_len, tiles.min_split_tokens)
        num_splits = max(1, min(wanted, useful))
    elif num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
    per_split = cdiv(cdiv(max(max_len, 1), num_splits), tiles.block_n) * tiles.block_n
    return max(1, cdiv(max_len, per_split)), per_split


def check_pool_and_query(q: torch.Tensor, pool: torch.Tensor, layer: int) -> None:
    """Raise :class:`KernelInputError` unless ``q``/``pool``/``layer`` fit together."""
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise KernelInputError(
            f"pool must be [slots, layers, 2, block_size, kv_heads, head_dim], got {tuple(pool.shape)}"
        )
    if q.dim() != 3:
        raise KernelInputError(f"q must be [N, num_q_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in KV_DTYPES:
        raise KernelInputError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if pool.dtype != q.dtype:
        raise KernelInputError(f"pool dtype {pool.dtype} differs from q dtype {q.dtype}")
    if q.device != pool.device:
        raise KernelInputError(f"q is on {q.device} but the pool is on {pool.device}")
    if q.shape[2] != pool.shape[5]:
        raise KernelInputError(f"q head_dim {q.shape[2]} differs from the pool's {pool.shape[5]}")
    if q.shape[1] % pool.shape[4] != 0:
        raise KernelInputError(
            f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {pool.shape[4]}"
        )
    if not 0 <= layer < pool.shape[1]:
        raise KernelInputError(f"layer {layer} out of range for a pool of {pool.shape[1]} layers")


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """Raise :class:`KernelInputError` unless ``t`` is an integer tensor of ``shape`` on ``device``."""
    if t.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise KernelInputError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device} but q is on {device}")


class RangeStats(NamedTuple):
    longest: int  # largest end - start
    total: int  # sum of end - start


def checked_ranges(starts: torch.Tensor, ends: torch.Tensor, capacity: int) -> RangeStats:
    """Length stats of ranges ``[start, end)`` after checking ``0 <= start <= end <= capacity``.

    Costs one device-to-host sync.
    """
    if ends.numel() == 0:
        return RangeStats(0, 0)
    lengths = ends.long() - starts.long()
    stats = torch.stack([lengths.max(), lengths.min(), lengths.sum(), starts.long().min(), ends.long().max()])
    longest, shortest, total, lowest, highest = (int(x) for x in stats.tolist())
    if shortest < 0 or lowest < 0:
        raise KernelInputError("every token range needs 0 <= start <= end")
    if highest > capacity:
        raise KernelInputError(f"a token range ending at {highest} does not fit a block table of {capacity} tokens")
    return RangeStats(longest, total)
