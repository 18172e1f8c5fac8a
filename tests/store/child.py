"""Helper process for the store tests (run as a script, never collected by pytest).

    child.py MODE SHM_DIR ARGS...

put HOME SEED N_CHAINS     put chains forever-ish, printing "ACK <seed> <i>" (flushed) after
                           each durable put; the parent kills it with SIGKILL at random.
torture HOME SEED OPS SMALL [WB]
                           random puts / acquires / pins / invalidations / page corruptions,
                           logging "BEGIN ..." and "ACK ..." lines (SMALL=1: a 16-slot disk, so
                           blocks are evicted from it; WB=1: write-back, write_through=False)
killat HOME SEED OPS SMALL POINT N [WB]
                           torture, but SIGKILL itself at the N-th call of a named step
                           (POINTS: "<step>:before" or "<step>:after", a step of STEPS)
check HOME SEED N_CHAINS   reopen and check chains 0..N-1 are found whole and byte-identical;
                           prints one JSON line.
hold HOME                  open the store, print "READY <pid>", wait for stdin to close.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.kit import BS, MV1, MV2, assert_lease_exact, open_store, pages_for, toks  # noqa: E402

from tierkv import Priority, Scope  # noqa: E402

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


def store_options(shm: str, small_disk: bool = False, write_back: bool = False, **kw: object) -> dict:
    # Small memory tiers, so every put demotes and evicts; a disk big enough that nothing
    # acknowledged is ever evicted from it, unless ``small_disk``. Write-back: puts stay in
    # memory (unacknowledged) until eviction writes them to disk.
    disk = 16 * 4096 if small_disk else 4096 * 4096
    return dict(shm_dir=Path(shm), device_bytes=4 * 1024, host_bytes=4 * 4096, disk_bytes=disk,
                segment_pages=4 if small_disk else 8, write_through=not write_back, **kw)


def corrupt_one_page(store, rng: random.Random, acked: list[int], seed: int) -> int | None:
    """Flip one byte of the on-disk page of a block of an acknowledged chain that sits on
    disk only (so the next acquire reads it and quarantines it). Returns the chain, or None."""
    import os

    from tierkv.identity import block_keys
    from tierkv.tiers import TierName

    for i in rng.sample(acked, min(len(acked), 8)):
        tokens, scope = chain_tokens(seed, i), scope_of(seed, i)
        with store.placement.lock:
            for key in block_keys(tokens, scope, BS):
                b = store.placement.table.get(key)
                if b is not None and set(b.loc) == {TierName.DISK} and not b.leases and not b.busy:
                    seg, off = store.disk.files.offset(b.loc[TierName.DISK])[::2]
                    print(f"CORRUPT {i}", flush=True)  # logged first: the chain may be lost now
                    fd = os.open(seg.path, os.O_RDWR)
                    try:
                        byte = os.pread(fd, 1, off + 7)
                        os.pwrite(fd, bytes([byte[0] ^ 0x20]), off + 7)
                    finally:
                        os.close(fd)
                    return i
    return None


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


def mode_torture(shm: str, home: str, seed: str, ops: str, small: str = "0", wb: str = "0") -> None:
    s, n_ops = int(seed), int(ops)
    rng = random.Random(s)
    store = open_store(Path(home), **store_options(shm, small == "1", wb == "1"))
    put_next = 0
    acked: list[int] = []
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.03 and acked:
            # Damage a page on disk, then read it: the read quarantines it (a kill point).
            i = corrupt_one_page(store, rng, acked, s)
            if i is not None:
                with store.acquire(chain_tokens(s, i), scope_of(s, i)) as lease:
                    assert_lease_exact(lease)
        elif op < 0.6 or put_next < 3:
            i = put_next
            put_next += 1
            tokens, scope = chain_tokens(s, i), scope_of(s, i)
            prio = Priority.PINNED if rng.random() < 0.1 else Priority.NORMAL
            print(f"BEGIN P {i}", flush=True)
            r = store.put(tokens, pages_for(tokens, scope), scope, priority=prio)
            if r.durable:
                print(f"ACK P {i} {prio.name}", flush=True)
                acked.append(i)
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


# The calls a crash can fall between, by step: put (segment creation, page runs, slot records,
# the synced write, the index commit), eviction, demotion, write-back, invalidation and
# quarantine. A (module or class, name) is hooked where it is called (the name as its caller
# looks it up), never process-wide: ``pwrite_all`` as the disk tier looks it up is its page
# write. A plain name is a pair of fault points, "<name>:before" / "<name>:after"
# (tierkv/core/faults.py), in the compiled modules, whose methods cannot be hooked.
STEPS: dict[str, tuple[str, str] | str] = {
    "segment-create": ("tierkv.tiers.disk_files", "create_segment"),  # a new segment file, renamed, dir synced
    "segment-dir-sync": ("tierkv.tiers.segments", "fsync_dir"),  # segment renamed, directory not yet synced
    "page-run-write": ("tierkv.tiers.disk", "pwrite_all"),  # one run of pages, not synced
    "records-write": ("tierkv.tiers.disk", "write_run_records"),  # pages written, records next, nothing synced
    "disk-write": ("tierkv.tiers.disk.DiskTier", "_write_pages"),  # after: pages and records synced, not indexed
    "index-put": ("tierkv.index.Index", "put_blocks"),  # after: indexed, not acknowledged
    "evict": "placement.evict",
    "demote": "placement.demote",  # device -> host, inside an eviction
    "write-back": "placement.write_back",  # the last memory copy to disk, inside an eviction
    "index-delete": ("tierkv.index.Index", "delete_blocks"),  # after: deleted, slot not freed
    "slot-free": ("tierkv.tiers.disk.DiskTier", "free"),
    "record-wipe": ("tierkv.tiers.disk", "wipe_record"),
    "invalidate": ("tierkv.core.operations.StoreOperations", "invalidate"),  # after: done, not acknowledged
    "retire": "placement.retire",
    "quarantine": "placement.quarantine",
    "index-quarantine": ("tierkv.index.Index", "quarantine"),
}
POINTS = tuple(f"{step}:{when}" for step in STEPS for when in ("before", "after"))
# Hooks reached only in some configurations: (small disk, write-back) that reach them.
NEEDS = {"write-back": (False, True)}


def _resolve(path: str):  # type: ignore[no-untyped-def]
    import importlib

    try:
        return importlib.import_module(path)
    except ImportError:
        mod, cls = path.rsplit(".", 1)
        return getattr(importlib.import_module(mod), cls)


def install_kill_point(point: str, n: int) -> None:
    """SIGKILL this process at the ``n``-th call of the step: just before the call runs
    (``:before``) or just after it returns (``:after``)."""
    import os
    import signal

    step, when = point.split(":")
    target = STEPS[step]
    if isinstance(target, str):  # a fault point: count its hits
        from tierkv.core import faults

        hits = [0]

        def kill_at_n() -> None:
            hits[0] += 1
            if hits[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

        faults.arm(f"{target}:{when}", kill_at_n)  # ValueError: the point was renamed; update STEPS
        return
    owner_path, attr = target
    owner = _resolve(owner_path)
    orig = getattr(owner, attr)  # AttributeError: the step moved; update STEPS
    calls = [0]

    def wrapper(*a, **kw):
        calls[0] += 1
        if calls[0] == n and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = orig(*a, **kw)
        if calls[0] == n and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, attr, wrapper)


def mode_killat(shm: str, home: str, seed: str, ops: str, small: str, point: str, n: str, wb: str = "0") -> None:
    install_kill_point(point, int(n))
    mode_torture(shm, home, seed, ops, small, wb)


def neighbours(i: int) -> set[int]:
    """Chains sharing blocks with chain ``i`` (chain 3k+2 extends chain 3k+1)."""
    return {i} | ({i + 1} if i % 3 == 1 else set()) | ({i - 1} if i % 3 == 2 else set())


def verify_run(home: Path, shm: Path, seed: int, lines: list[str], small_disk: bool = False,
               write_back: bool = False) -> dict:
    """Reopen a store a torture run left behind (killed or not) and check it against the
    run's own log: every acknowledged chain still whole (on the big disk; pinned ones on
    the small disk) and byte-identical, invalidated chains gone, an interrupted
    invalidation all-or-nothing, never a wrong byte, and a clean integrity check. A chain
    whose page the run damaged on purpose (CORRUPT) may be lost, never served wrong."""
    corrupted: set[int] = set()
    acked: dict[int, bool] = {}  # chain -> pinned
    gone: set[int] = set()
    begun: set[int] = set()
    pending_put: int | None = None
    pending_inv: str | None = None
    begun_at: dict[int, int] = {}  # chain -> position of its BEGIN P in the log
    gone_at: dict[int, int] = {}  # chain -> position of the ACK I that removed it
    for pos, line in enumerate(lines):
        p = line.split()
        if p[:2] == ["BEGIN", "P"]:
            pending_put = int(p[2])
            begun.add(pending_put)
            begun_at[pending_put] = pos
        elif p[:2] == ["ACK", "P"]:
            acked[int(p[2])] = p[3] == "PINNED"
            pending_put = None
        elif p[:2] == ["BEGIN", "I"]:
            pending_inv = p[2]
        elif p[:2] == ["ACK", "I"]:
            for i in [i for i in acked if scope_of(seed, i).namespace == p[2]]:
                del acked[i]
                gone.add(i)
                gone_at[i] = pos
            pending_inv = None
        elif p[:1] == ["CORRUPT"]:
            corrupted |= neighbours(int(p[1]))
    problems: list[str] = []
    store = open_store(home, **{**store_options(str(shm), small_disk, write_back), "device_bytes": 16 * 1024})
    try:
        store.check_integrity()

        def whole(i: int) -> bool:
            tokens, scope = chain_tokens(seed, i), scope_of(seed, i)
            return store.lookup(tokens, scope).num_blocks == len(tokens) // BS

        for i in sorted(begun):  # never a wrong byte, whatever survived
            tokens, scope = chain_tokens(seed, i), scope_of(seed, i)
            with store.acquire(tokens, scope) as lease:
                try:
                    assert_lease_exact(lease)
                except AssertionError as e:
                    problems.append(f"chain {i}: {e}")
        # A chain damaged on purpose may be partly gone already; on the small disk so may any
        # chain that is not pinned (evicted): neither says anything about the invalidation.
        in_flux = [i for i in acked if pending_inv and scope_of(seed, i).namespace == pending_inv
                   and i not in corrupted and (acked[i] or not small_disk)]
        if in_flux and len({whole(i) for i in in_flux}) > 1:
            problems.append(f"interrupted invalidation of {pending_inv} was not all-or-nothing")
        for i, pinned in acked.items():
            if i in in_flux or i in corrupted or (small_disk and not pinned):
                continue
            if not whole(i):
                problems.append(f"acknowledged chain {i} lost")
        shared = set(acked) | ({pending_put} if pending_put is not None else set())
        for i in gone:
            # Chains 3k+1 and 3k+2 share blocks. A chain still acknowledged, the put in flight,
            # or any put begun after this invalidation (acknowledged or not: on the small disk
            # a put can store part of a chain and report durable=False) may hold them again.
            later = {j for j, at in begun_at.items() if at > gone_at[i]}
            if neighbours(i) & (shared | later):
                continue
            tokens, scope = chain_tokens(seed, i), scope_of(seed, i)
            if store.lookup(tokens, scope).num_blocks:
                problems.append(f"invalidated chain {i} still served")
        stray = [p.name for p in (home / "segments").iterdir() if not p.name.endswith((".safetensors", ".bad"))]
        if stray:
            problems.append(f"stray files in segments/: {stray}")
        stats = store.stats()
    except AssertionError as e:
        problems.append(f"integrity: {e}")
        stats = {}
    finally:
        store.close()
    return {"acked": len(acked), "gone": len(gone), "blocks": stats.get("blocks"), "corrupted": len(corrupted),
            "quarantined": stats.get("quarantined"), "problems": problems}


def _forked_child(args: list[str]) -> tuple[int, "object"]:
    """Run a torture mode in a forked copy of this process (torch already imported, so a
    trial starts in milliseconds, not seconds); its stdout is the returned pipe. Call only
    from a process with no other threads running."""
    import os
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r)
            sys.stdout = os.fdopen(w, "w", buffering=1)
            mode, shm, *rest = args
            {"torture": mode_torture, "killat": mode_killat}[mode](shm, *rest)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


def run_trial(workdir: Path, seed: int, *, ops: int = 400, small_disk: bool = False, kill_after_acks: int | None = None,
              point: str | None = None, n: int = 1, fork: bool = True, timeout: float = 120.0,
              write_back: bool = False) -> dict:
    """One crash trial: a torture child killed with SIGKILL after ``kill_after_acks``
    acknowledgements (plus a random few milliseconds), or by itself at the ``n``-th call
    of ``point``; then :func:`verify_run` on what it left. ``fork=False`` starts the child
    as a fresh interpreter instead of a fork. Returns the report plus how the child ended:
    ``killed`` is true only when the planned kill happened (the point fired, or the parent
    killed it after its acknowledgements), not when the child finished first or timed out."""
    import os
    import signal
    import subprocess
    import time

    home, shm = workdir / "home", workdir / "shm"
    args = [str(a) for a in (["killat", shm, home, seed, ops, int(small_disk), point, n, int(write_back)] if point
                             else ["torture", shm, home, seed, ops, int(small_disk), int(write_back)])]
    proc = None
    if fork:
        pid, stream = _forked_child(args)
    else:
        proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
        pid, stream = proc.pid, proc.stdout
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    status = None
    sent = timed_out = False
    try:
        acks = 0
        for line in stream:  # type: ignore[attr-defined]
            lines.append(line.strip())
            if line.startswith("ACK"):
                acks += 1
            timed_out = time.monotonic() > deadline
            if (kill_after_acks is not None and acks >= kill_after_acks) or timed_out:
                time.sleep(random.Random(seed).random() * 0.02)  # land somewhere inside the next op
                os.kill(pid, signal.SIGKILL)
                sent = True
                break
        lines += [x.strip() for x in stream.read().splitlines()]  # type: ignore[attr-defined]
    finally:
        if proc is not None:
            proc.kill() if proc.poll() is None else None
            status = proc.wait()
        else:
            _, raw = os.waitpid(pid, 0)
            status = os.waitstatus_to_exitcode(raw)
        stream.close()  # type: ignore[attr-defined]
    try:
        report = verify_run(home, shm, seed, lines, small_disk, write_back)
    except Exception as e:  # a home the trial left unopenable is a failure, reported as one
        report = {"acked": 0, "gone": 0, "blocks": None, "corrupted": 0, "quarantined": None,
                  "problems": [f"reopen failed: {type(e).__name__}: {e}"]}
    died = status == -signal.SIGKILL
    # A point trial counts as killed only if the point killed it (the parent sent nothing);
    # a random trial only if the parent's kill (not a timeout) found it still running.
    report["killed"] = died and not timed_out and (sent if point is None else not sent)
    report["timed_out"] = timed_out
    report["returncode"] = status
    report["finished"] = "DONE" in lines
    return report


def mode_check(shm: str, home: str, seed: str, n_chains: str) -> None:
    s, n = int(seed), int(n_chains)
    # A device tier big enough to lease the longest chain (12 blocks) at once.
    store = open_store(Path(home), **{**store_options(shm), "device_bytes": 16 * 1024})
    found = bad = 0
    for i in range(n):
        tokens, scope = chain_tokens(s, i), scope_of(s, i)
        with store.acquire(tokens, scope) as lease:
            if lease.num_blocks == len(tokens) // BS == store.lookup(tokens, scope).num_blocks:
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


if __name__ == "__main__":
    mode, shm, *rest = sys.argv[1:]
    modes = {"put": mode_put, "torture": mode_torture, "killat": mode_killat, "check": mode_check, "hold": mode_hold}
    modes[mode](shm, *rest)
