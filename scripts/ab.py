#!/usr/bin/env python
"""The performance guard: this tree against a base commit, alternated, beside a null pair.

Each benchmark ("probe") runs in a fresh process, once for the base revision's ``tierkv``
(taken from git with ``git archive``), once for this working tree's, and once more for the
base (the *null*: the same code again), in an order that rotates from pair to pair, so all
three see the machine in the same minutes. A pair's ratio is tree / base throughput (>1:
this tree is faster); the null's is base / base, and its spread is the noise any ratio must
be read against. Medians over ``--pairs``.

    .venv/bin/python scripts/ab.py                         # base: docs/performance-baseline
    .venv/bin/python scripts/ab.py --base eedbb0d --bench store-write --pairs 5
    .venv/bin/python scripts/ab.py --check                 # CI: exit 1 below --min-ratio

Probes (higher is better; the store opened before the clock starts in each). The guard's
three, run by default (GB/s of pages):
  store-write   durable puts of --gib GiB of 1 MiB pages, 64 blocks a put, into a new home
  store-read    one acquire of all of them from a reopened home, page cache dropped (cold)
  restore       a 4,096-token prefix of a 30-layer model's KV (189 MB, fp32) from a cold
                disk into transformers' per-layer layout: ``tierkv.hf.restore_cache`` where
                the revision has it, else one acquire and ``Lease.kv()``
and, asked for by name (``--bench``), this tree's benchmark scripts run against each
revision's ``tierkv`` (the daemon they start is the revision's too):
  daemon-1      scripts/bench_daemon.py: acquire/release iterations/s of 1 client process
  daemon-32     the same with 32 client processes against one daemon
  replay        scripts/replay_trace.py: requests/s of the store replaying the generated
                zipf-scan trace at 500 blocks, policy arc (the metadata path)
  vllm-hit      scripts/bench_vllm.py --small: 1 / TTFT of a same-engine hit through the
                embedded connector; needs ``--python`` naming the vLLM venv's interpreter
                (scripts/ci_vllm.sh builds it), about two minutes a run
The replay's lockstep A/B in one process, with a compiled base, is scripts/replay_ab.py.

Both revisions run as plain Python (TIERKV_PURE_PYTHON=1) unless ``--compiled``: the base
from an archive has no compiled modules, and the disk and restore paths spend their time in
I/O and copies, not in the metadata path the compiler speeds up.

``--check`` fails (exit 1) when a probe's median ratio is below ``--min-ratio``; the
default, 0.80, lies below every null median measured on a 2-vCPU VM (docs/performance.md,
"The guard") and above the ratios of the regression it was built to catch (defb350 against
eedbb0d: 0.2-0.6).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE_FILE = REPO / "docs" / "performance-baseline"
PROBES = ("store-write", "store-read", "restore")  # the guard's (the default)
SCRIPT_PROBES = ("daemon-1", "daemon-32", "replay", "vllm-hit")


# ---- probes: run in a child process whose sys.path holds the revision's tierkv --------------
def _store_layout():  # type: ignore[no-untyped-def]
    from tierkv.layout import PageLayout

    # 1 MiB pages (16 layers x 2 x 16 tokens x 8 heads x 128 dims, fp16), as bench_store.py.
    return PageLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")


def _fill(home: Path, layout, gib: float):  # type: ignore[no-untyped-def]
    """Durable puts of ``gib`` GiB into a new home; returns (GB/s, tokens, scope, opts)."""
    import numpy as np
    import torch

    import tierkv
    from tierkv.identity import Scope

    n = max(64, int(gib * (1 << 30)) // layout.page_bytes)
    rng = np.random.default_rng(2)
    pages = torch.from_numpy(rng.integers(0, 256, size=(n, layout.page_bytes), dtype=np.uint8)).view(
        layout.torch_dtype).reshape(n, *layout.shape)
    tokens = rng.integers(0, 150_000, size=n * layout.block_size)
    scope = Scope("ab" * 32)
    opts = dict(device_bytes=(n + 1) * layout.page_bytes, host_bytes=0, disk_bytes=(n + 64) * layout.slot_bytes,
                segment_pages=256)
    with tierkv.open(home, layout, **opts) as store:
        t0 = time.perf_counter()
        for s in range(0, n, 64):
            k = min(64, n - s)
            r = store.put(tokens[: (s + k) * layout.block_size], pages[s : s + k], scope, start_block=s)
            assert r.durable and r.stored == k, r
        rate = n * layout.page_bytes / (time.perf_counter() - t0) / 1e9
    return rate, tokens, scope, opts


def _drop_cache(home: Path) -> None:
    from tierkv.tiers.diskio import drop_page_cache

    drop_page_cache(sorted(p for p in (home / "segments").glob("*") if p.is_file()))


def probe(name: str, work: Path, gib: float) -> float:
    import tierkv

    if name in ("store-write", "store-read"):
        layout = _store_layout()
        rate, tokens, scope, opts = _fill(work / "home", layout, gib)
        if name == "store-write":
            return rate
        _drop_cache(work / "home")
        with tierkv.open(work / "home", layout, **opts) as store:
            t0 = time.perf_counter()
            with store.acquire(tokens, scope) as lease:
                n = lease.num_blocks
                elapsed = time.perf_counter() - t0
            assert n * layout.block_size == len(tokens), n
        return n * layout.page_bytes / elapsed / 1e9
    if name == "restore":
        import torch

        from tierkv.layout import PageLayout

        layout = PageLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
        gib_of_prefix = 4096 // 16 * layout.page_bytes / (1 << 30)
        _, tokens, scope, opts = _fill(work / "home", layout, gib_of_prefix)
        _drop_cache(work / "home")

        class Model:  # what restore_cache reads of a model
            device, dtype = torch.device("cpu"), layout.torch_dtype

        try:
            from tierkv.hf.prefill import restore_cache
        except ImportError:
            restore_cache = None
        import transformers.cache_utils  # noqa: F401 - a serving process has it loaded: not timed
        n_blocks = len(tokens) // layout.block_size
        with tierkv.open(work / "home", layout, **opts) as store:
            t0 = time.perf_counter()
            if restore_cache is not None:
                got = restore_cache(store, tokens, scope, n_blocks, Model()).tokens
            else:
                with store.acquire(tokens, scope) as lease:
                    got = int(lease.kv()[0][0].shape[2])  # layer 0's K: [1, H, tokens, D]
            elapsed = time.perf_counter() - t0
        assert got == len(tokens), got
        return n_blocks * layout.page_bytes / elapsed / 1e9
    if name in SCRIPT_PROBES:
        return script_probe(name)
    raise SystemExit(f"unknown probe {name!r} (known: {', '.join(PROBES + SCRIPT_PROBES)})")


def script_probe(name: str) -> float:
    """A figure of one of this tree's benchmark scripts, run by this interpreter with the
    revision's ``tierkv`` first on PYTHONPATH (inherited from the probe's environment)."""
    scripts = Path(__file__).resolve().parent
    if name.startswith("daemon-"):
        cmd = [str(scripts / "bench_daemon.py"), "--clients", name.split("-")[1], "--seconds", "3", "--runs", "1",
               "--no-shm", "--json"]
        key = "daemon_n_iterations_per_s"
    elif name == "replay":
        cmd = [str(scripts / "replay_trace.py"), "--generated", "zipf-scan", "--capacity", "500", "--policy", "arc",
               "--reference", "lru", "--json"]
        key = "replay"
    else:
        cmd = [str(scripts / "bench_vllm.py"), "--small", "--skip", "offloading,simple_cpu_offload",
               "--throughput-configs", "vllm_apc", "--json"]
        key = "vllm-hit"
    done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:1])} failed:\n{done.stderr[-3000:]}")
    raw = done.stdout.strip()  # the JSON object is last; replay_trace.py indents it over many lines
    out = json.loads(raw if raw.startswith("{") else raw[raw.rfind("\n{") + 1 :])
    if key == "replay":
        return next(float(r["requests_per_s"]) for r in out["rows"] if r["kind"] == "store")
    if key == "vllm-hit":
        return 1.0 / float(out["ttft_s"]["tierkv_embedded_same_engine_hit"])
    return float(out[key])


# ---- the driver ------------------------------------------------------------------------------
def archive(rev: str, into: Path) -> Path:
    """``tierkv`` of git revision ``rev`` unpacked under ``into`` (a directory for sys.path)."""
    into.mkdir(parents=True)
    tar_path = into / "src.tar"
    with tar_path.open("wb") as f:
        done = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "tierkv"], stdout=f,
                              stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cannot take revision {rev!r} from git: {done.stderr.strip()} "
                         "(a shallow clone lacks it: git fetch --unshallow)")
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    tar_path.unlink()
    return into


def run_probe(src: Path, name: str, gib: float, directory: Path | None, compiled: bool, python: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    if not compiled:
        env["TIERKV_PURE_PYTHON"] = "1"
    with tempfile.TemporaryDirectory(prefix="tierkv-ab-", dir=directory) as work:
        cmd = [python, str(Path(__file__).resolve()), "--probe", name, "--gib", str(gib), "--work", work]
        done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"probe {name} failed under {src}:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="git revision (default: the one named in docs/performance-baseline)")
    ap.add_argument("--bench", action="append", choices=PROBES + SCRIPT_PROBES,
                    help=f"probe to run (repeat; default: {', '.join(PROBES)})")
    ap.add_argument("--pairs", type=int, default=5, help="alternated rounds per probe (medians over them)")
    ap.add_argument("--gib", type=float, default=0.5, help="GiB of pages for the store probes")
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--compiled", action="store_true", help="leave compiled modules on (default: plain Python)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a median ratio is below --min-ratio")
    ap.add_argument("--min-ratio", type=float, default=0.80)
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter of the probes (vllm-hit: the vLLM venv's; default: this one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        print(probe(args.probe, args.work, args.gib))
        return 0
    base = args.base or BASELINE_FILE.read_text().split()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierkv-ab-src-") as tmp:
        srcs = {"base": archive(base, Path(tmp) / "base"), "tree": REPO, "null": archive(base, Path(tmp) / "null")}
        for name in args.bench or PROBES:
            got: dict[str, list[float]] = {k: [] for k in srcs}
            for i in range(args.pairs):
                order = list(srcs)[i % 3:] + list(srcs)[: i % 3]  # rotate who goes first
                for who in order:
                    got[who].append(run_probe(srcs[who], name, args.gib, args.dir, args.compiled, args.python))
            ratios = [t / b for t, b in zip(got["tree"], got["base"])]
            nulls = [n / b for n, b in zip(got["null"], got["base"])]
            row = {"probe": name, "base": base, "pairs": args.pairs, "ratio_median": statistics.median(ratios),
                   "null_median": statistics.median(nulls), "ratios": ratios, "nulls": nulls,
                   "unit": "GB/s" if name in PROBES else "per s",
                   "tree_median": statistics.median(got["tree"]), "base_median": statistics.median(got["base"])}
            rows.append(row)
            if not args.json:
                print(f"{name:<12} tree/base {row['ratio_median']:.3f} [{', '.join(f'{r:.2f}' for r in ratios)}]"
                      f"   null {row['null_median']:.3f} [{', '.join(f'{r:.2f}' for r in nulls)}]"
                      f"   {row['unit']} tree {row['tree_median']:.2f} base {row['base_median']:.2f}", flush=True)
    if args.json:
        print(json.dumps({"base": base, "load_avg": os.getloadavg()[0], "rows": rows}, indent=2))
    failed = [r["probe"] for r in rows if r["ratio_median"] < args.min_ratio]
    if args.check and failed:
        print(f"performance guard: {', '.join(failed)} below {args.min_ratio} of {base} "
              "(a slowdown against the accepted baseline; docs/performance.md, 'The guard')", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
