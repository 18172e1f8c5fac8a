"""A model of the store's memory tier over its disk tier, for choosing what goes to disk.

:mod:`tierkv.traces` models one tier; this models two, with the store's rules where they
decide hit rates: a request is served the longest prefix held by either tier; a block
served from disk is promoted into memory (the store's acquire) or read through; each tier
evicts leaf first with its own :mod:`tierkv.core.policy` order; a block whose last memory
copy is evicted and is not on disk is written back; a write to disk takes the block's
missing cached prefix first (tierkv/core/placement.py ``flush_to_disk``), so the disk holds
whole prefixes, and never a block whose prefix is in neither tier (no request can reach it).
Write-through writes each new block when it is put, write-back only when it leaves memory,
and a :mod:`tierkv.disk_admission` rule decides both. Counts disk writes beside the hits: a
rule that writes less for the same hits is worth having even where the hits do not move.
The store does not run the admission rules (docs/eviction.md, "The host and disk tiers'
admission", says why); ``all`` is what it does.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from .disk_admission import ADMISSIONS, AdmitEither, DiskAdmission, make_admission
from .core.policy import HINT_CONTINUATION, HINT_FRESH, HINT_TAIL
from .core.policy_mix import make_policy
from .traces import Request, _Cache, _tree


@dataclass(frozen=True)
class TieredResult:
    blocks: int  # blocks asked for
    host_hits: int  # served from the small (host) tier
    disk_hits: int  # served from the large (disk) tier
    disk_writes: int = 0  # blocks written to the disk tier

    @property
    def hit_rate(self) -> float:
        return (self.host_hits + self.disk_hits) / self.blocks if self.blocks else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hits / self.blocks if self.blocks else 0.0


class _Tier:
    """One simulated tier: residency, leaf-first victims, a :mod:`tierkv.core.policy` order."""

    def __init__(self, parent: dict[int, int | None], capacity: int, policy: str) -> None:
        self.cache = _Cache(parent)
        self.capacity = capacity
        self.policy = make_policy(policy, capacity)

    def __contains__(self, x: int) -> bool:
        return x in self.cache.resident

    def insert(self, x: int, hint: int, protect: set[int], evicting: Callable[[int], None] | None = None) -> bool:
        """Make ``x`` resident, evicting a leaf outside ``protect`` if full (``evicting`` is
        told of it while it is still resident). Returns whether ``x`` is resident."""
        if x in self.cache.resident:
            return True
        if not self.capacity:
            return False
        if len(self.cache.resident) >= self.capacity:
            kids = self.cache.kids
            v = next((k for k in self.policy.candidates() if k not in protect and kids[k] == 0), None)  # type: ignore[call-overload]
            if v is None:
                return False
            if evicting is not None:
                evicting(v)
            self.cache.drop(v)
            self.policy.remove(v, True)  # type: ignore[arg-type]
        self.cache.add(x)
        self.policy.add(x, hint)  # type: ignore[arg-type]
        return True

    def touch(self, ids: Sequence[int], hit: bool) -> None:
        self.policy.touch([x for x in ids if x in self.cache.resident][::-1], hit)  # type: ignore[arg-type]


class TwoTiers:
    """One memory tier over one disk tier, a request at a time (the module docstring's rules)."""

    def __init__(self, parent: dict[int, int | None], host: int, disk: int, policy: str,
                 admission: DiskAdmission[int], promote: bool = True, admit_on_second: bool = False,
                 write_back: bool = False) -> None:
        self.parent = parent
        self.h, self.d = _Tier(parent, host, policy), _Tier(parent, disk, policy)
        self.host = host
        self.adm = admission
        self.promote, self.admit_on_second, self.write_back = promote, admit_on_second, write_back
        self.seen: OrderedDict[int, None] = OrderedDict()
        self.host_hits = self.disk_hits = self.blocks = self.writes = 0
        self._protect: set[int] = set()

    def _to_disk(self, x: int, hint: int = HINT_FRESH) -> None:
        # flush_to_disk: the missing cached prefix first, root first; none of it a victim.
        h, d, parent = self.h, self.d, self.parent
        chain = [x]
        p = parent[x]
        while p is not None and (p in h or p in d):
            chain.append(p)
            p = parent[p]
        if p is not None:
            # Its prefix is in neither tier: no request can reach it, so it is not written
            # (an orphan on disk would also enter the tier before its parent, which leaf-
            # first counting (traces._Cache) does not allow for).
            return
        keep = self._protect | set(chain)
        for y in reversed(chain):
            if y not in d:
                if not d.insert(y, hint if y == x else HINT_FRESH, keep):
                    return
                self.writes += 1

    def _evicting(self, v: int) -> None:
        on_disk = v in self.d
        if self.adm.leaving(v, on_disk) and not on_disk:
            self._to_disk(v)

    def request(self, ids: Sequence[int]) -> int:
        """Serve one request's ids and store the rest; returns its hits (blocks)."""
        h, d, adm = self.h, self.d, self.adm
        self.blocks += len(ids)
        n = 0
        for x in ids:
            if x not in h and x not in d:
                break
            n += 1
        in_host = [x for x in ids[:n] if x in h]
        self.host_hits += len(in_host)
        self.disk_hits += n - len(in_host)
        for x in ids[:n]:
            adm.served(x, x not in h)
        h.policy.touch(in_host[::-1], True)  # type: ignore[arg-type]
        d.policy.touch([x for x in ids[:n] if x in d][::-1], True)  # type: ignore[arg-type]
        self._protect = protect = set(ids)
        if self.promote:
            for x in ids[:n]:
                h.insert(x, HINT_FRESH, protect, self._evicting)
        seen = self.seen
        for i in range(n, len(ids)):
            x = ids[i]
            hint = (HINT_CONTINUATION if n else HINT_FRESH) | (HINT_TAIL if i == len(ids) - 1 else 0)
            if adm.stored(x) and not self.write_back:  # asked either way: the rule tracks the block
                self._to_disk(x, hint)
            if (self.admit_on_second and x not in seen) or not h.insert(x, hint, protect, self._evicting):
                if x not in d:  # no memory tier takes it: the store writes it from the put's page
                    self._evicting(x)
        for x in ids:
            seen[x] = None
            seen.move_to_end(x)
        while len(seen) > 4 * max(1, self.host):
            seen.popitem(last=False)
        h.touch(ids, False)
        d.touch(ids, False)
        return n

    def result(self) -> TieredResult:
        return TieredResult(self.blocks, self.host_hits, self.disk_hits, self.writes)


def simulate_tiers(trace: Sequence[Request], host: int, disk: int, policy: str, promote: bool = True,
                   admit_on_second: bool = False, write_back: bool = False,
                   admission: str = "all") -> TieredResult:
    """A memory tier of ``host`` blocks over a disk tier of ``disk`` blocks. ``promote``: a
    block served from disk is copied into memory; otherwise it is read through.
    ``admit_on_second``: a new block enters memory only if its id was seen before (a
    bounded doorkeeper of 4 x host ids). ``write_back``: new blocks reach disk only when
    they leave memory (the store's ``write_through=False``); else when put. ``admission``:
    one of :data:`tierkv.disk_admission.ADMISSIONS` or ``adaptive``
    (:func:`_adaptive`)."""
    parent = _tree(trace)
    args = (promote, admit_on_second, write_back)
    if admission == "adaptive":
        return _adaptive(trace, parent, host, disk, policy, args)
    if admission not in ADMISSIONS:
        raise ValueError(f"unknown disk admission {admission!r}; choose one of {(*ADMISSIONS, 'adaptive')}")
    tiers = TwoTiers(parent, host, disk, policy, make_admission(admission, disk, host), *args)
    for r in trace:
        tiers.request(r.hash_ids)
    return tiers.result()


def _adaptive(trace: Sequence[Request], parent: dict[int, int | None], host: int, disk: int, policy: str,
              args: tuple[bool, bool, bool], half_life: float = 32.0) -> TieredResult:
    """Admission by whichever rule is winning: the whole two-tier system replayed under
    ``all`` and under ``reused`` beside the real one (exact, metadata-only shadows), which
    answers as the shadow with more hits, decayed with a half-life of ``half_life`` x the
    disk's capacity in blocks asked. Half-life 32 was chosen on the develop set and the
    synthetic trace: 8 switched too often (each switch mixes the two rules' disks, worst
    row -0.0068), none (hits since the start) stayed too long (worst -0.0042); a cheap
    variant scoring each key against LRU shadow disks, blind to prefixes, lost up to
    0.0146 (docs/eviction.md)."""
    shadows = {name: TwoTiers(parent, host, disk, policy, make_admission(name, disk, host), *args)
               for name in ("all", "reused")}
    follow = AdmitEither[int](disk, host)
    real = TwoTiers(parent, host, disk, policy, follow, *args)
    scores = dict.fromkeys(shadows, 0.0)
    decay_per_block = 0.5 ** (1.0 / (half_life * max(1, disk)))
    for r in trace:
        ids = r.hash_ids
        decay = decay_per_block ** len(ids)
        for name, s in shadows.items():
            scores[name] = scores[name] * decay + s.request(ids)
        real.request(ids)
        # Ties keep "all": it lets go of no block that might come back.
        follow.choice = "reused" if scores["reused"] > scores["all"] else "all"
    return real.result()
