#!/usr/bin/env python
"""How fast this host is right now, in two numbers that the store's metadata path depends on:
a dict lookup among 20,000 random 32-byte keys (the block table's and policies' operation)
and SHA-256 of 2 KiB (a 512-token block's key). On a shared VM both move by 1.5-2x from one
minute to the next with the neighbours' load; run this beside a replay
(scripts/replay_trace.py) to tell a slow host from slow code (docs/performance-history.md).

    .venv/bin/python scripts/host_speed.py
"""
from __future__ import annotations

import hashlib
import os
import time


def main() -> None:
    table = {os.urandom(32): i for i in range(20_000)}
    keys = list(table)
    t0 = time.perf_counter()
    for _ in range(50):
        for k in keys:
            table[k]
    lookup_ns = (time.perf_counter() - t0) / (50 * len(keys)) * 1e9
    block = os.urandom(2048)
    t0 = time.perf_counter()
    for _ in range(20_000):
        hashlib.sha256(block).digest()
    sha_us = (time.perf_counter() - t0) / 20_000 * 1e6
    print(f"dict lookups {lookup_ns:.1f} ns/op; sha256 2KB {sha_us:.2f} us")


if __name__ == "__main__":
    main()
