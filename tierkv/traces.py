"""Prefix-cache traces (Mooncake's format) and reference simulators of one cache tier.

A trace is one JSON object a line with ``timestamp``, ``input_length``, ``output_length``
and ``hash_ids``: one id per 512-token block, equal ids meaning equal prefixes (so an id
names a block *and* everything before it). Each request finds the longest cached prefix of
its ids (its hits), then stores the rest. The simulators below replay that on a tree of
ids with the store's rules (:mod:`tierkv.core.blocks`): leaf first (a block goes only after its
extensions), the request's own chain is never a victim while it is stored, and blocks
enter in chain order, each evicting as needed.

- :func:`simulate_lru`: tierkv's LRU (a chain touched leaf first, root last);
- :func:`simulate_lru2`: LRU-2 (the oldest second-to-last use goes first; blocks used once
  before any used twice), leaf first; uses counted since the block entered the cache
  (``lru2``) or over the whole trace (``lru2-history``: see the function);
- :func:`simulate_belady`: the offline optimum for this request model: the leaf whose next
  use is furthest goes (a parent is used whenever its child is, so the furthest next use
  always has a leaf; ties go to the deeper block);
- :func:`simulate_policy`: any :mod:`tierkv.core.policy` policy, for fast experiments and as the
  model the store's replay must agree with exactly. Each returns a :class:`SimResult`.
"""
from __future__ import annotations

import heapq
import json
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .core.policy import HINT_CONTINUATION, HINT_FRESH, HINT_TAIL
from .core.policy_mix import make_policy

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces
_INF = 1 << 62


@dataclass(frozen=True)
class Request:
    hash_ids: tuple[int, ...]
    input_length: int


@dataclass(frozen=True)
class SimResult:
    hits: tuple[int, ...]  # per request: blocks of its cached prefix

    def block_hit_rate(self, trace: Sequence[Request]) -> float:
        total = sum(len(r.hash_ids) for r in trace)
        return sum(self.hits) / total if total else 0.0

    def token_hit_rate(self, trace: Sequence[Request]) -> float:
        """Hit tokens over input tokens, counting full 512-token blocks only (a request's
        trailing partial block is never served from a cache of whole blocks)."""
        total = sum(r.input_length for r in trace)
        hit = sum(min(h, r.input_length // TRACE_BLOCK) * TRACE_BLOCK for h, r in zip(self.hits, trace))
        return hit / total if total else 0.0


def read_trace(path: str | Path, limit: int | None = None, full_blocks_only: bool = False) -> list[Request]:
    """Requests of a Mooncake-format trace. ``full_blocks_only`` drops each request's
    trailing partial block (what a store of whole blocks would see); by default every id
    counts, as in Mooncake's own hit-rate figures."""
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            ids = tuple(int(x) for x in obj["hash_ids"])
            length = int(obj.get("input_length", len(ids) * TRACE_BLOCK))
            if full_blocks_only:
                ids = ids[: length // TRACE_BLOCK]
            out.append(Request(ids, length))
            if limit is not None and len(out) >= limit:
                break
    return out


def block_tokens(hash_id: int, block_size: int = TRACE_BLOCK) -> np.ndarray:
    """Token ids of the block named ``hash_id``: a function of the id alone (the key chain
    supplies the prefix), distinct for distinct ids below 2**31 / block_size and mixed
    (splitmix64) above."""
    if 0 <= hash_id < (1 << 31) // block_size:
        base = hash_id * block_size
    else:
        z = (hash_id + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        base = (z ^ (z >> 31)) % ((1 << 31) - block_size)
    return np.arange(base, base + block_size, dtype="<i4")


def _tree(trace: Iterable[Request]) -> dict[int, int | None]:
    parent: dict[int, int | None] = {}
    for r in trace:
        for i, x in enumerate(r.hash_ids):
            parent.setdefault(x, r.hash_ids[i - 1] if i else None)
    return parent


class _Cache:
    """Residency with child counts, shared by the simulators (leaf = no resident child)."""

    def __init__(self, parent: dict[int, int | None]) -> None:
        self.parent = parent
        self.resident: set[int] = set()
        self.kids: dict[int, int] = defaultdict(int)

    def prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for x in ids:
            if x not in self.resident:
                break
            n += 1
        return n

    def add(self, x: int) -> None:
        self.resident.add(x)
        p = self.parent[x]
        if p is not None and p in self.resident:
            self.kids[p] += 1

    def drop(self, x: int) -> None:
        self.resident.discard(x)
        p = self.parent[x]
        if p is not None and p in self.resident:
            self.kids[p] -= 1


def _replay(trace: Sequence[Request], capacity: int, on_hit: Callable[[int, list[int]], None],
            on_insert: Callable[[int, int, int, int], None], victim: Callable[[Callable[[int], bool]], int | None],
            on_evict: Callable[[int], None], after: Callable[[int, list[int]], None]) -> SimResult:
    cache = _Cache(_tree(trace))
    hits: list[int] = []
    for r_i, r in enumerate(trace):
        ids = r.hash_ids
        n = cache.prefix(ids)
        hits.append(n)
        on_hit(r_i, list(ids[:n]))
        current = set(ids)

        def ok(k: int) -> bool:
            return k not in current and cache.kids[k] == 0

        for i in range(n, len(ids)):
            x = ids[i]
            if x in cache.resident:
                continue
            if len(cache.resident) >= capacity:
                v = victim(ok)
                if v is None:
                    break
                cache.drop(v)
                on_evict(v)
            cache.add(x)
            hint = (HINT_CONTINUATION if n else HINT_FRESH) | (HINT_TAIL if i == len(ids) - 1 else 0)
            on_insert(r_i, x, i, hint)
        after(r_i, [x for x in ids if x in cache.resident])
    return SimResult(tuple(hits))


def simulate_policy(trace: Sequence[Request], capacity: int, policy: str) -> SimResult:
    """The store's rules with :mod:`tierkv.core.policy`'s ``policy`` ordering victims."""
    pol = make_policy(policy, capacity)

    def victim(ok: Callable[[int], bool]) -> int | None:
        return next((k for k in pol.candidates() if ok(k)), None)  # type: ignore[arg-type]

    return _replay(
        trace, capacity,
        on_hit=lambda r, ks: pol.touch(ks[::-1], True),  # type: ignore[arg-type]
        on_insert=lambda r, x, i, hint: pol.add(x, hint),  # type: ignore[arg-type]
        victim=victim,
        on_evict=lambda x: pol.remove(x, True),  # type: ignore[arg-type]
        after=lambda r, ks: pol.touch(ks[::-1], False),  # type: ignore[arg-type]
    )


def simulate_lru(trace: Sequence[Request], capacity: int) -> SimResult:
    """tierkv's leaf-first LRU, with plain OrderedDicts (independent of tierkv.core.policy)."""
    order: OrderedDict[int, None] = OrderedDict()

    def touch(ks: list[int]) -> None:
        for k in reversed(ks):
            order.move_to_end(k)

    def victim(ok: Callable[[int], bool]) -> int | None:
        return next((k for k in order if ok(k)), None)

    return _replay(trace, capacity, on_hit=lambda r, ks: touch(ks),
                   on_insert=lambda r, x, i, h: order.__setitem__(x, None), victim=victim,
                   on_evict=lambda x: order.__delitem__(x), after=lambda r, ks: touch(ks))


class _LazyHeap:
    """A min-heap of keys whose priority changes: stale entries are skipped when popped."""

    def __init__(self) -> None:
        self.prio: dict[int, tuple[int, ...]] = {}
        self.heap: list[tuple[tuple[int, ...], int]] = []

    def set(self, x: int, prio: tuple[int, ...]) -> None:
        self.prio[x] = prio
        heapq.heappush(self.heap, (prio, x))

    def pop_first(self, ok: Callable[[int], bool]) -> int | None:
        skipped = []
        found = None
        while self.heap:
            prio, x = heapq.heappop(self.heap)
            if self.prio.get(x) != prio:
                continue
            if not ok(x):
                skipped.append((prio, x))
                continue
            found = x
            break
        for e in skipped:
            heapq.heappush(self.heap, e)
        if found is not None:
            del self.prio[found]
        return found


def simulate_lru2(trace: Sequence[Request], capacity: int, keep_history: bool = False) -> SimResult:
    """LRU-2 by request: the victim has the oldest second-to-last use (blocks used in one
    request only come first, oldest last use first); ties go to the deeper block.

    Two rankings differ in what "used in one request" means (issue #33). By default (the
    reference ``lru2``) a block's uses are counted since it last entered the cache: an
    evicted block that comes back is "seen once" again. ``keep_history`` (``lru2-history``,
    the issue's "LRU-2, leaf-first" figures: 0.0890 / 0.4425 / 0.6260 on the synthetic trace
    at 1,000 / 10,000 / 30,000 blocks) remembers every block's last two uses for the whole
    trace (unbounded metadata, which no store keeps), so a block that returns after an
    eviction is ranked by its earlier use; far stronger when the cache is small."""
    h = _LazyHeap()
    last: dict[int, tuple[int, int]] = {}  # id -> (second-to-last use, last use); -1 = none
    depth: dict[int, int] = {}

    def hit(r: int, ks: list[int]) -> None:
        for k in ks:
            a, b = last[k]
            last[k] = (b, r)
            h.set(k, (b, r, -depth[k]))

    def insert(r: int, x: int, i: int, hint: int) -> None:
        depth[x] = i
        b = last[x][1] if keep_history and x in last else -1
        last[x] = (b, r)
        h.set(x, (b, r, -i))

    def victim(ok: Callable[[int], bool]) -> int | None:
        v = h.pop_first(ok)
        if v is not None and not keep_history:
            del last[v]
        return v

    return _replay(trace, capacity, on_hit=hit, on_insert=insert, victim=victim,
                   on_evict=lambda x: None, after=lambda r, ks: None)


def simulate_belady(trace: Sequence[Request], capacity: int) -> SimResult:
    """The offline optimum (Belady's MIN) with the prefix constraint, as described above."""
    uses: dict[int, list[int]] = defaultdict(list)
    for r_i, r in enumerate(trace):
        for x in r.hash_ids:
            uses[x].append(r_i)
    pos: dict[int, int] = defaultdict(int)
    depth: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, id)
    nxt: dict[int, int] = {}

    def next_use(x: int, r: int) -> int:
        u, p = uses[x], pos[x]
        while p < len(u) and u[p] <= r:
            p += 1
        pos[x] = p
        return u[p] if p < len(u) else _INF

    def set_next(x: int, r: int) -> None:
        nxt[x] = next_use(x, r)
        heapq.heappush(heap, (-nxt[x], -depth[x], x))

    def hit(r: int, ks: list[int]) -> None:
        for k in ks:
            set_next(k, r)

    def insert(r: int, x: int, i: int, hint: int) -> None:
        depth[x] = i
        set_next(x, r)

    def victim(ok: Callable[[int], bool]) -> int | None:
        skipped = []
        found = None
        while heap:
            e = heapq.heappop(heap)
            if nxt.get(e[2]) != -e[0]:
                continue
            if not ok(e[2]):
                skipped.append(e)
                continue
            found = e[2]
            break
        for e in skipped:
            heapq.heappush(heap, e)
        if found is not None:
            del nxt[found]
        return found

    return _replay(trace, capacity, on_hit=hit, on_insert=insert, victim=victim,
                   on_evict=lambda x: None, after=lambda r, ks: None)


REFERENCES: dict[str, Callable[[Sequence[Request], int], SimResult]] = {
    "lru": simulate_lru, "lru2": simulate_lru2, "belady": simulate_belady,
    "lru2-history": lambda trace, capacity: simulate_lru2(trace, capacity, keep_history=True),
}
