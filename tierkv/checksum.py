"""Page checksums: xxh3-64 over the page bytes, seeded by the block key.

Seeding by the key means a page copied (with its checksum) under another key fails
verification, on top of the token-id comparison every hit already makes.
"""
from __future__ import annotations

import torch
import xxhash


def page_checksum(key: bytes, page: torch.Tensor) -> int:
    data = page.detach().cpu().contiguous().view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(key[:8], "little"))


def page_checksums(keys: list[bytes], pages: torch.Tensor, rows: list[int]) -> list[int]:
    """``page_checksum(keys[j], pages[rows[j]])`` for every j, converting the batch to bytes
    once (a put of many small pages spent most of its time in per-page conversions)."""
    if not keys:
        return []
    data = pages.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(pages.shape[0], -1)
    return [xxhash.xxh3_64_intdigest(data[r], seed=int.from_bytes(k[:8], "little")) for k, r in zip(keys, rows)]
