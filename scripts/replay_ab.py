#!/usr/bin/env python
"""Replay a trace through this tree's store and another revision's, in lockstep.

This machine's speed drifts by 10-30% within seconds (shared host), more than most changes
to the store's metadata path are worth, so replays run one after the other (even
alternated, even in one process) compare the machine's moments, not the code. Here both
stores replay the same trace side by side: request ``i`` goes through one store, then the
other (which goes first alternates), each timed on its own, so both see the machine at the
same moment and the ratio of their times is steady where their rates are not.

The other revision's ``tierkv`` package is taken from git (``git archive``) into a
temporary directory as ``tierkv_base`` (its imports are relative, so it runs under that
name beside this tree's ``tierkv``); when this tree runs compiled, the base's metadata path
is compiled too, with mypyc, as its own setup.py lists it (``--no-compile-base``: plain
Python). Both replay exactly what ``scripts/replay_trace.py``
does (acquire, release, put of the missing blocks; one in-memory tier of N pages); their
per-request hits must be equal, which is also checked (the hit rate must not change when
the metadata path gets faster: issue #12).

    .venv/bin/python scripts/replay_ab.py ../shared/traces/synthetic_trace.jsonl --base HEAD~3 \\
        --capacity 1000 --capacity 10000 --capacity 30000 --repeat 2
"""
from __future__ import annotations

import argparse
import ast
import gc
import hashlib
import importlib
import importlib.util
import json
import re
import runpy
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

import tierkv
from tierkv import native
from tierkv.daemon.gc_pauses import freeze_startup_heap
from tierkv.policy import POLICIES
from tierkv.traces import TRACE_BLOCK, Request, block_tokens, read_trace

REPO = Path(__file__).resolve().parent.parent


def import_revision(rev: str, into: Path, compile_it: bool = False) -> ModuleType:
    """The ``tierkv`` package of git revision ``rev``, imported as ``tierkv_base``;
    ``compile_it``: its metadata path compiled first, as that revision's setup.py would."""
    archive = into / "base.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "tierkv", "setup.py"], stdout=f,
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "src", filter="data")
    (into / "src" / "tierkv").rename(into / "src" / "tierkv_base")
    if compile_it:
        compile_revision(into / "src")
    sys.path.insert(0, str(into / "src"))
    return importlib.import_module("tierkv_base")


def compiled_list(src: Path) -> list[str]:
    """The modules revision ``src`` compiles: tierkv/compiled.py's MODULES (stdlib-only, so it
    runs by path), or, before issue #32, the COMPILED list in its setup.py."""
    contract = src / "tierkv_base" / "compiled.py"
    if contract.exists():
        return list(runpy.run_path(str(contract))["MODULES"])
    listed = re.search(r"^COMPILED = (\[.*?\])", (src / "setup.py").read_text(), re.S | re.M)
    if listed is None:
        raise SystemExit("the base revision names no compiled modules: run without --compile-base")
    return list(ast.literal_eval(listed.group(1)))


def compile_revision(src: Path) -> None:
    """Compile ``src/tierkv_base``'s metadata path in place with mypyc (a minute or two):
    the modules its own setup.py lists, under the package's new name, and the manifest
    tierkv.native checks (else the base would run as plain Python against a compiled tree,
    and the ratio would measure the compiler)."""
    modules = [m.replace("tierkv.", "tierkv_base.", 1) for m in compiled_list(src)]
    paths = [m.replace(".", "/") + ".py" for m in modules]
    script = (
        "import sys\nfrom setuptools import setup\nfrom mypyc.build import mypycify\n"
        f"setup(name='tierkv_base', ext_modules=mypycify(['--ignore-missing-imports', '--follow-imports=silent', "
        f"*{paths!r}], opt_level='3', group_name='tierkv_base._metadata'), script_args=['build_ext', '--inplace'])\n"
    )
    print(f"compiling the base's {len(paths)} modules with mypyc...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-c", script], cwd=src, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling the base failed:\n{done.stderr[-2000:]}")
    digests = {m: hashlib.sha256((src / p).read_bytes()).hexdigest() for m, p in zip(modules, paths)}
    (src / "tierkv_base" / "_native.json").write_text(json.dumps({"python": sys.implementation.cache_tag,
                                                                  "sources": digests}))


def trace_layout(mod: ModuleType) -> object:
    """The replay's page layout (as scripts/replay_trace.py's), built by ``mod``'s tierkv."""
    return mod.PageLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=TRACE_BLOCK, dtype="float16")


def open_store(mod: ModuleType, home: str, capacity: int, policy: str) -> object:
    layout = trace_layout(mod)
    return mod.open(home, layout, device="cpu", device_bytes=capacity * layout.page_bytes, host_bytes=0,
                    disk_bytes=0, eviction_policy=policy, prefetch_workers=1, shm_dir=Path(home))


def lockstep(mods: list[ModuleType], trace: list[Request], arrays: list[np.ndarray], pages: torch.Tensor,
             capacity: int, policy: str) -> tuple[list[float], list[list[int]]]:
    """Seconds each store spent on the replay, and each one's hits per request."""
    spent = [0.0] * len(mods)
    hits: list[list[int]] = [[] for _ in mods]
    clock = time.perf_counter
    with tempfile.TemporaryDirectory() as h0, tempfile.TemporaryDirectory() as h1:
        stores = [open_store(m, h, capacity, policy) for m, h in zip(mods, (h0, h1))]
        scopes = [m.Scope("ab" * 32, "replay") for m in mods]
        try:
            for i, (r, arr) in enumerate(zip(trace, arrays)):
                for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                    store, scope = stores[j], scopes[j]
                    t0 = clock()
                    lease = store.acquire(arr, scope)
                    n = len(lease.keys)
                    store.release(lease)
                    if n < len(r.hash_ids):
                        store.put(arr, pages[: len(r.hash_ids) - n], scope, start_block=n)
                    spent[j] += clock() - t0
                    hits[j].append(n)
            for s in stores:
                s.check_integrity()
        finally:
            for s in stores:
                s.close()
    return spent, hits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a Mooncake-format .jsonl")
    ap.add_argument("--base", default="HEAD", help="git revision to compare this tree with (default: HEAD)")
    ap.add_argument("--capacity", type=int, action="append", help="tier size in blocks (repeat; default 1000)")
    ap.add_argument("--policy", default="arc", choices=POLICIES)
    ap.add_argument("--repeat", type=int, default=1, help="lockstep replays per capacity (ratio: median)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compile-base", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the base's metadata path with mypyc first (default: when this tree runs compiled)")
    args = ap.parse_args(argv)
    compile_base = args.compile_base
    if compile_base is None:  # like for like: compiled when this tree is and mypyc is here to build it
        compile_base = native.status()["compiled"] != [] and importlib.util.find_spec("mypyc") is not None
        if native.status()["compiled"] and not compile_base:
            print("mypyc is not installed here: the base runs as plain Python against this compiled tree "
                  "(pip install mypy==2.4.1, or --no-compile-base to silence this)", file=sys.stderr)
    trace = read_trace(args.trace, args.limit)
    cache: dict[int, np.ndarray] = {}
    arrays = [np.concatenate([cache.setdefault(x, block_tokens(x)) for x in r.hash_ids]) for r in trace]
    longest = max(len(r.hash_ids) for r in trace)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierkv-ab-") as tmp:
        mods = [import_revision(args.base, Path(tmp), compile_base), tierkv]
        print(f"base {args.base}: {mods[0].native.describe()}; this tree: {native.describe()}", file=sys.stderr)
        layout = trace_layout(mods[1])
        pages = torch.zeros((longest, *layout.shape), dtype=layout.torch_dtype)
        for cap in args.capacity or [1000]:
            runs = []
            for _ in range(args.repeat):
                # The harness's heap (torch, numpy, the trace) out of the collector, as in
                # scripts/replay_trace.py: a full collection would walk it in whichever
                # store's turn it fell. The stores' own blocks are collected as usual.
                freeze_startup_heap()
                try:
                    spent, hits = lockstep(mods, trace, arrays, pages, cap, args.policy)
                finally:
                    gc.unfreeze()
                if hits[0] != hits[1]:
                    differ = sum(a != b for a, b in zip(*hits))
                    raise SystemExit(f"capacity {cap}: the stores' hits differ on {differ} requests")
                runs.append({"base_rps": len(trace) / spent[0], "tree_rps": len(trace) / spent[1],
                             "speedup": spent[0] / spent[1], "block_hits": sum(hits[1])})
            row = {"capacity": cap, "policy": args.policy, "base": args.base, "runs": runs,
                   "speedup_median": statistics.median(r["speedup"] for r in runs)}
            rows.append(row)
            if not args.json:
                print(f"capacity {cap:>6} {args.policy}: this tree / {args.base} speed "
                      f"{row['speedup_median']:.3f} (runs {', '.join(format(r['speedup'], '.3f') for r in runs)}); "
                      f"req/s {', '.join('%.0f vs %.0f' % (r['tree_rps'], r['base_rps']) for r in runs)}; "
                      f"hits equal ({runs[0]['block_hits']} blocks)", flush=True)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "requests": len(trace), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
