"""The CLI conformance kit: twin stores, one opened by each command (``--home``) and one
served by a daemon (``--socket``), filled with the same blocks and manifests, and the
comparison of a command's ``--json`` through both (test_cli.py: one layout;
test_cli_two_layouts.py: a home and a daemon holding two layouts).

The daemon is restarted after the fill, so that neither side holds anything in memory:
then even the per-tier residency must agree. Fields that differ by nature are dropped
before a comparison (paths, timings, the per-process traffic counters, the daemon's own
section).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from click.testing import CliRunner, Result
from helpers.daemons import DaemonThread

import tierkv
from tierkv import PageLayout, Scope, block_keys
from tierkv.cli import main

from .kit import pages_for, remove, run_daemon, short_dir

MV_B = hashlib.sha256(b"conformance cli model b").hexdigest()
SIZES = dict(device_bytes=8 << 20, host_bytes=8 << 20, disk_bytes=64 << 20)
# Fields that differ by nature: how long a run took, and where each side keeps its files.
TIMINGS = {"elapsed_s", "tokens_per_s", "ttft_s", "total_s", "path", "home", "created_at", "file_bytes",
           "signed_by"}
# Traffic counters describe the process holding the store (the daemon's accumulate).
STATS_PER_PROCESS = {"lookups", "lookup_blocks", "hits", "hit_rate", "hit_rate_by_tier", "acquires", "acquire_hits",
                     "evictions", "promoted_bytes", "demoted_bytes", "puts", "blocks_stored", "lookups_per_s",
                     "mean_lookup_ms", "daemon", "device", "host", "index_resizes", "stale_readers_cleared",
                     "disk_read_path", "read_path", "layouts",
                     "capacity_bytes", "limit_segments"}  # the command opens a home with default capacities
# The second layout of the two-layout twins, and the model whose blocks it holds.
OTHER = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
MV_O = hashlib.sha256(b"conformance cli model o").hexdigest()


def run(*args: Any, ok: bool = True, input: str | None = None) -> Result:
    result = CliRunner().invoke(main, [str(a) for a in args], input=input)
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    return result


def run_json(*args: Any) -> dict:
    lines = run(*args, "--json").stdout.strip().splitlines()
    return json.loads(lines[-1])


def drop(obj: Any, keys: set[str] = TIMINGS) -> Any:
    if isinstance(obj, dict):
        return {k: drop(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [drop(v, keys) for v in obj]
    return obj


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 300, n).astype(np.int32)


def manifest_for(toks: np.ndarray, scope: Scope, layout: PageLayout) -> dict:
    keys = block_keys(toks, scope, layout.block_size)
    return {"kind": "prefix", "format": 1, "model_version": scope.model_version, "layout": layout.to_dict(),
            "tokens": len(toks), "blocks": len(keys), "last_block_key": keys[-1].hex(), "pinned": False,
            "tokens_sha256": hashlib.sha256(toks.tobytes()).hexdigest(), "created_at": "2026-01-01T00:00:00+00:00"}


def fill(api: Any, layout: PageLayout, mv: str) -> None:
    """A named prefix 'docs' (6 blocks), 3 blocks of namespace t1 and 4 of another model."""
    bs = layout.block_size
    docs = tokens(1, 6 * bs)
    for scope, toks in ((Scope(mv), docs), (Scope(mv, "t1"), tokens(2, 3 * bs)), (Scope(MV_B), tokens(3, 4 * bs))):
        assert api.put(toks, pages_for(toks, scope, layout), scope).durable
    api.save_manifest("docs", manifest_for(docs, Scope(mv), layout))


def fill_other(api: Any) -> None:
    """A named prefix 'other-docs' (5 blocks of OTHER, namespace t2, its manifest naming its
    layout) and 2 blocks of MV_B: another model's blocks in the second layout's store."""
    bs = OTHER.block_size
    docs, scope = tokens(11, 5 * bs), Scope(MV_O, "t2")
    for sc, toks in ((scope, docs), (Scope(MV_B), tokens(12, 2 * bs))):
        assert api.put(toks, pages_for(toks, sc, OTHER), sc).durable
    api.save_manifest("other-docs", {**manifest_for(docs, scope, OTHER), "namespace": "t2"})


def run_two_layout_daemon(workdir: Path, layout: PageLayout) -> DaemonThread:
    """A daemon that serves two layouts on its home (run_daemon gives one layout the whole
    budget, layouts.max_open=1)."""
    from tierkv.daemon.config import DaemonConfig, LayoutSettings, ServerSettings, StagingSettings, StoreSettings

    return DaemonThread(DaemonConfig(
        store=StoreSettings(home=workdir / "home", device="cpu", shm_dir=workdir / "shm", warm_at_open=False, **SIZES),
        server=ServerSettings(socket=workdir / "d.sock", workers=2),
        staging=StagingSettings(region_bytes=256 * layout.slot_bytes, per_client_bytes=64 * layout.slot_bytes),
        layouts=LayoutSettings(preload=layout, max_open=2))).start()


@dataclass
class Twins:
    home: Path
    runner: DaemonThread
    model_dir: Path
    layout: PageLayout
    mv: str
    two_layouts: bool = False

    @property
    def socket(self) -> Path:
        return self.runner.socket

    def both(self, *args: Any) -> tuple[dict, dict]:
        """The command's --json output with --home, then with --socket."""
        return run_json(*args, "--home", self.home), run_json(*args, "--socket", self.socket)

    def same(self, *args: Any, ignore: set[str] = frozenset()) -> dict:
        a, b = self.both(*args)
        a, b = drop(a, TIMINGS | ignore), drop(b, TIMINGS | ignore)
        assert a == b, f"{args}: --home gave {a}, --socket gave {b}"
        return a

    def restart_daemon(self) -> None:
        workdir = self.runner.config.store.home.parent
        self.runner.stop()
        self.runner = (run_two_layout_daemon(workdir, self.layout) if self.two_layouts
                       else run_daemon(workdir, self.layout, **SIZES))


@contextlib.contextmanager
def open_twins(model_dir: Path, two_layouts: bool) -> Iterator[Twins]:
    """The twins of ``model_dir``'s layout, filled (:func:`fill`); ``two_layouts``: the home
    also holds OTHER under layouts/<id> (made here, as a daemon would), and the daemon
    serves both (:func:`fill_other` on each side)."""
    from tierkv.hf import version_of
    from tierkv.home import store_home

    layout, mv = version_of(model_dir)
    hdir, ddir = short_dir("tkvcli-h-"), short_dir("tkvcli-d-")
    home = hdir / "home"
    try:
        with tierkv.open(home, layout, device="cpu", shm_dir=hdir / "shm", **SIZES) as s:
            fill(s, layout, mv)
        if two_layouts:
            assert store_home(home, OTHER) == home / "layouts" / "bfloat16-l3-h1-d32-b32"
            with tierkv.open(store_home(home, OTHER), OTHER, device="cpu", shm_dir=hdir / "shm", **SIZES) as s:
                fill_other(s)
        t = Twins(home, run_two_layout_daemon(ddir, layout) if two_layouts else run_daemon(ddir, layout, **SIZES),
                  model_dir, layout, mv, two_layouts)
        try:
            with tierkv.connect(t.socket, layout=layout) as c:
                fill(c, layout, mv)
            if two_layouts:
                with tierkv.connect(t.socket, layout=OTHER) as c:
                    fill_other(c)
            t.restart_daemon()  # nothing in memory on either side
            yield t
        finally:
            t.runner.stop()
    finally:
        remove(hdir)
        remove(ddir)
