"""Page checksums: xxh3-64 over the page bytes, seeded by the block key.

Seeding by the key means a page copied (with its checksum) under another key fails
verification, on top of the token-id comparison every hit already makes.
"""
from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

_SEED = struct.Struct("<Q")  # a page's checksum seed: the first 8 bytes of its key, little-endian
# torch dtypes numpy can view without a copy (bfloat16 and the fp8 types it cannot).
_NUMPY_DTYPES = frozenset({torch.float32, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int16,
                           torch.int32, torch.int64})


def page_checksum(key: bytes, page: torch.Tensor) -> int:
    data = page.detach().cpu().contiguous().view(torch.uint8).numpy()
    digest: int = xxhash.xxh3_64_intdigest(data.data, seed=int.from_bytes(key[:8], "little"))  # xxhash: Any to mypyc
    return digest


def page_rows(pages: torch.Tensor) -> np.ndarray:
    """Pages ``[n, ...]`` as a uint8 numpy array ``[n, page bytes]`` (no copy for contiguous
    CPU pages). Through numpy where it knows the dtype: half the cost of torch's chain of
    calls, paid on every put (once: its checksums and its copy into the tier share it)."""
    t = pages.detach()
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.is_contiguous():
        return t.numpy().view(np.uint8).reshape(t.shape[0], -1)
    return t.cpu().contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1)


def row_checksums(keys: list[bytes], data: np.ndarray, rows: list[int]) -> list[int]:
    """``page_checksum(keys[j], pages[rows[j]])`` for every j, given ``data = page_rows(pages)``,
    in one pass: a put converts its pages to bytes once, for these and for the copy into
    the memory tier (a put of many small pages spent most of its time in per-page
    conversions)."""
    if not keys:
        return []
    # Rows as slices of one flat memoryview (a numpy row view per page cost more than the
    # hash of a small page), the seed as page_checksum takes it: the key's first 8 bytes.
    step = data.shape[1]
    flat = np.ascontiguousarray(data).reshape(-1).data
    digest, seed = xxhash.xxh3_64_intdigest, _SEED.unpack_from
    return [digest(flat[r * step : (r + 1) * step], seed(k)[0]) for k, r in zip(keys, rows)]
