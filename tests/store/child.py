"""Helper process for the store tests (run as a script, never collected by pytest).

    child.py MODE SHM_DIR ARGS...

put HOME SEED N_CHAINS     put chains forever-ish, printing "ACK <seed> <i>" (flushed) after
                           each durable put; the parent kills it with SIGKILL at random.
torture HOME SEED OPS      random puts / acquires / pins / invalidations (scripts/crash_torture.py)
check HOME SEED N_CHAINS   reopen and check chains 0..N-1 are found whole and byte-identical;
                           prints one JSON line.
hold HOME                  open the store, print "READY <pid>", wait for stdin to close.
keys                       print the block keys of a fixed request (PYTHONHASHSEED test).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.kit import BS, MV1, MV2, assert_lease_exact, keys_of, open_store, pages_for, toks  # noqa: E402

from tierkv import Priority, Scope  # noqa: E402
from tierkv.identity import block_keys  # noqa: E402

NAMESPACES = ("ns0", "ns1", "ns2")


def chain_tokens(seed: int, i: int) -> list[int]:
    """Chain i of a run: 1-6 blocks; every third chain extends chain i-1 (shared prefix)."""
    rng = random.Random(seed * 100_003 + i)
    n = rng.randint(1, 6)
    if i % 3 == 2:
        return chain_tokens(seed, i - 1) + toks(seed * 7 + i, n)
    return toks(seed * 1_000_003 + i, n)


def chain_scope(seed: int, i: int) -> Scope:
    return Scope(MV1 if (seed + i) % 5 else MV2, namespace=NAMESPACES[i % 3 if i % 3 != 2 else 1])


def scope_of(seed: int, i: int) -> Scope:
    # A chain that extends chain i-1 lives in chain i-1's scope.
    return chain_scope(seed, i - 1) if i % 3 == 2 else chain_scope(seed, i)


def store_options(shm: str, **kw: object) -> dict:
    # Small memory tiers (so every put demotes and evicts), a disk big enough that nothing
    # acknowledged is ever evicted from it.
    return dict(shm_dir=Path(shm), device_bytes=4 * 1024, host_bytes=4 * 4096, disk_bytes=4096 * 4096,
                segment_pages=8, **kw)


def mode_put(shm: str, home: str, seed: str, n_chains: str) -> None:
    s, n = int(seed), int(n_chains)
    store = open_store(Path(home), **store_options(shm))
    for i in range(n):
        tokens, scope = chain_tokens(s, i), scope_of(s, i)
        r = store.put(tokens, pages_for(tokens, scope), scope)
        if r.durable:
            print(f"ACK {s} {i}", flush=True)
    store.close()
    print("DONE", flush=True)


def mode_torture(shm: str, home: str, seed: str, ops: str) -> None:
    s, n_ops = int(seed), int(ops)
    rng = random.Random(s)
    store = open_store(Path(home), **store_options(shm))
    put_next = 0
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.6 or put_next < 3:
            i = put_next
            put_next += 1
            tokens, scope = chain_tokens(s, i), scope_of(s, i)
            prio = Priority.PINNED if rng.random() < 0.1 else Priority.NORMAL
            print(f"BEGIN P {i}", flush=True)
            r = store.put(tokens, pages_for(tokens, scope), scope, priority=prio)
            if r.durable:
                print(f"ACK P {i}", flush=True)
        elif op < 0.8:
            i = rng.randrange(put_next)
            tokens, scope = chain_tokens(s, i), scope_of(s, i)
            with store.acquire(tokens, scope) as lease:
                assert_lease_exact(lease)
        elif op < 0.9:
            ns = rng.choice(NAMESPACES)
            print(f"BEGIN I {ns}", flush=True)
            store.invalidate(namespace=ns)
            print(f"ACK I {ns}", flush=True)
        else:
            i = rng.randrange(put_next)
            store.set_priority(chain_tokens(s, i), scope_of(s, i), Priority.PINNED)
    store.check_integrity()
    store.close()
    print("DONE", flush=True)


def mode_check(shm: str, home: str, seed: str, n_chains: str) -> None:
    s, n = int(seed), int(n_chains)
    store = open_store(Path(home), **store_options(shm))
    found = bad = 0
    for i in range(n):
        tokens, scope = chain_tokens(s, i), scope_of(s, i)
        with store.acquire(tokens, scope) as lease:
            if lease.num_blocks == len(tokens) // BS:
                found += 1
            try:
                assert_lease_exact(lease)
            except AssertionError:
                bad += 1
    store.check_integrity()
    print(json.dumps({"found": found, "bad": bad, "blocks": store.stats()["blocks"]}), flush=True)
    store.close()


def mode_hold(shm: str, home: str) -> None:
    import os

    store = open_store(Path(home), **store_options(shm))
    print(f"READY {os.getpid()}", flush=True)
    sys.stdin.read()
    store.close()


def mode_keys(shm: str) -> None:
    scope = Scope(MV1, namespace="tenant-a", extra_keys=("lora:x",))
    keys = block_keys(list(range(1000, 1013)), scope, BS, [["img:1"]])
    print(json.dumps([scope.seed.hex(), *[k.hex() for k in keys], keys_of(list(range(8)))[1].hex()]), flush=True)


if __name__ == "__main__":
    mode, shm, *rest = sys.argv[1:]
    {"put": mode_put, "torture": mode_torture, "check": mode_check, "hold": mode_hold, "keys": mode_keys}[mode](shm, *rest)
