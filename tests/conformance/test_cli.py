"""Every CLI command with ``--home`` and with ``--socket``: the same store contents behind
each (a home opened by the command, a daemon serving its own home), the same ``--json``.

The twins are filled through the API with the same blocks and manifests, and the daemon is
restarted before the commands run, so that neither side holds anything in memory: then
even the per-tier residency must agree. Fields that differ by nature are dropped before the
comparison (paths, timings, the per-process traffic counters, the daemon's own section).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Scope, block_keys
from tierkv.cli import main

from helpers.daemons import DaemonThread

from .kit import pages_for, remove, run_daemon, short_dir

pytestmark = pytest.mark.usefixtures("private_caches")
MV_B = hashlib.sha256(b"conformance cli model b").hexdigest()
SIZES = dict(device_bytes=8 << 20, host_bytes=8 << 20, disk_bytes=64 << 20)
TIMINGS = {"elapsed_s", "tokens_per_s", "ttft_s", "total_s", "path", "home", "created_at", "file_bytes",
           "signed_by"}


def run(*args: Any, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args])
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


@dataclass
class Twins:
    home: Path
    runner: DaemonThread
    model_dir: Path
    layout: PageLayout
    mv: str

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
        workdir = self.runner.config.home.parent
        self.runner.stop()
        self.runner = run_daemon(workdir, self.layout, **SIZES)


@pytest.fixture
def twins(llama_dir, monkeypatch, tmp_path):
    from tierkv.hf import version_of

    monkeypatch.delenv("TIERKV_SOCKET", raising=False)
    monkeypatch.setenv("TIERKV_KEYS", str(tmp_path / "keys"))
    layout, mv = version_of(llama_dir)
    hdir, ddir = short_dir("tkvcli-h-"), short_dir("tkvcli-d-")
    home = hdir / "home"
    with tierkv.open(home, layout, device="cpu", shm_dir=hdir / "shm", **SIZES) as s:
        fill(s, layout, mv)
    runner = run_daemon(ddir, layout, **SIZES)
    t = Twins(home, runner, llama_dir, layout, mv)
    try:
        with tierkv.connect(runner.socket) as c:
            fill(c, layout, mv)
        t.restart_daemon()  # nothing in memory on either side
        yield t
    finally:
        t.runner.stop()
        remove(hdir)
        remove(ddir)


# Traffic counters describe the process holding the store (the daemon's accumulate).
STATS_PER_PROCESS = {"lookups", "lookup_blocks", "hits", "hit_rate", "hit_rate_by_tier", "acquires", "acquire_hits",
                     "evictions", "promoted_bytes", "demoted_bytes", "puts", "blocks_stored", "lookups_per_s",
                     "mean_lookup_ms", "daemon", "device", "host", "index_resizes", "stale_readers_cleared",
                     "disk_read_path", "read_path", "layouts",
                     "capacity_bytes", "limit_segments"}  # the command opens a home with default capacities


def test_stats_and_ls(twins):
    s = twins.same("stats", ignore=STATS_PER_PROCESS)
    assert s["blocks"] == 13 and s["tiers"]["disk"]["blocks"] == 13
    assert s["model_versions"] == {twins.mv: 9, MV_B: 4} and s["namespaces"] == {"default": 10, "t1": 3}
    listing = twins.same("ls")
    [docs] = listing["prefixes"]
    assert docs["name"] == "docs" and docs["complete"] and docs["resident"] == {"blocks": 6, "device": 0, "host": 0,
                                                                                 "disk": 6}
    for args in (("stats",), ("ls",)):  # the tables too
        assert run(*args, "--home", twins.home).stdout == run(*args, "--socket", twins.socket).stdout \
            or args == ("stats",)  # the stats table shows per-process counters


def test_pin_unpin(twins):
    assert twins.same("pin", "docs") == {"name": "docs", "pinned": True, "blocks": 6, "expected_blocks": 6}
    assert twins.same("ls")["prefixes"][0]["pinned"] is True
    assert twins.same("unpin", "docs")["blocks"] == 6
    assert twins.same("ls")["prefixes"][0]["pinned"] is False
    r = run("pin", "nope", "--socket", twins.socket, ok=False)
    assert r.exit_code == 1 and "no prefix named 'nope'" in r.output


def test_invalidate_and_verify(twins):
    v = twins.same("verify")
    assert v["integrity_checked"] and v["integrity_error"] is None and v["ok"] and v["checked"] == 13 and v["corrupt"] == [] and v["unreadable"] == []
    dry = twins.same("invalidate", "--model-version", MV_B, "--dry-run")
    assert dry["removed_blocks"] == 4 and dry["dry_run"]
    assert twins.same("invalidate", "--model-version", MV_B)["removed_blocks"] == 4
    assert twins.same("invalidate", "--namespace", "t1")["removed_blocks"] == 3
    assert twins.same("invalidate", "--model", twins.model_dir, "--dry-run")["removed_blocks"] == 6
    assert twins.same("stats", ignore=STATS_PER_PROCESS)["blocks"] == 6
    assert twins.same("verify", "--repair")["checked"] == 6


def test_gc(twins):
    dry = twins.same("gc", "--dry-run")
    assert dry["removed_blocks"] == 7 and dry["kept_scopes"] == [[twins.mv, "default"]]
    assert twins.same("gc", "--keep-namespace", "t1")["removed_blocks"] == 4
    assert twins.same("stats", ignore=STATS_PER_PROCESS)["blocks"] == 9
    assert twins.same("gc", "--keep-model", twins.model_dir)["removed_blocks"] == 0


def test_export_import_across(twins, tmp_path):
    out_h, out_s = tmp_path / "h.tkv", tmp_path / "s.tkv"
    a = run_json("export", "docs", "-o", out_h, "--home", twins.home)
    b = run_json("export", "docs", "-o", out_s, "--socket", twins.socket)
    assert drop(a) == drop(b) and a["blocks"] == 6
    # Each side imports the other's bundle under a new name: same pages, so all skipped.
    ih = run_json("import", out_s, "--name", "copy", "--home", twins.home)
    isock = run_json("import", out_h, "--name", "copy", "--socket", twins.socket)
    assert drop(ih) == drop(isock)
    assert ih["skipped_blocks"] == 6 and ih["stored_blocks"] == 0 and ih["durable"]
    twins.restart_daemon()  # export leased the pages into the daemon's device tier
    assert [p["name"] for p in twins.same("ls")["prefixes"]] == ["copy", "docs"]
    twins.same("invalidate", "--model-version", twins.mv)
    assert twins.same("import", out_h, "--name", "docs", "--force")["stored_blocks"] == 6
    twins.restart_daemon()  # the daemon keeps imported pages in memory too
    assert twins.same("ls")["prefixes"][1]["complete"]


def test_materialize_generate_route(twins, repo):
    made = twins.same("materialize", repo, "--model", twins.model_dir, "--name", "repo", "--no-progress")
    assert made["stored_blocks"] == made["tokens"] // 16 > 0 and made["computed_tokens"] > 0
    ask = ("generate", "--model", twins.model_dir, "--prompt", "store the block", "--max-new-tokens", "4")
    warm = twins.same(*ask, "--prefix", "repo")
    assert warm["cached_tokens"] == made["tokens"] // 16 * 16
    cold = twins.same(*ask, "--prefix", "repo", "--no-cache")
    assert cold["cached_tokens"] == 0 and cold["tokens"] == warm["tokens"]
    assert cold["prompt_tokens"] == warm["prompt_tokens"]
    # route: the home and the daemon as nodes hold the same blocks.
    r = run_json("route", "--node", twins.home, "--node", twins.socket, "--prefix", "repo", "--model",
                 twins.model_dir)
    assert list(r["per_node"].values()) == [warm["cached_tokens"]] * 2 and not r["errors"]
    assert r["best_node"] == str(twins.home)  # a tie goes to the node listed first
    tiers = list(r["tiers"].values())
    assert sum(tiers[0].values()) == sum(tiers[1].values())
    mv = run_json("model-version", twins.model_dir)  # needs no store
    assert mv["model_version"] == twins.mv


# ---- a home with two page layouts (what a daemon serving two models makes) -------------------
OTHER = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
MV_O = hashlib.sha256(b"conformance cli model o").hexdigest()


def run_two_layout_daemon(workdir: Path, layout: PageLayout) -> DaemonThread:
    """A daemon that serves two layouts on its home (run_daemon gives one layout the whole
    budget, max_layouts=1)."""
    from tierkv.daemon.config import DaemonConfig

    return DaemonThread(DaemonConfig(home=workdir / "home", socket=workdir / "d.sock", layout=layout, device="cpu",
                                     staging_bytes=256 * layout.slot_bytes, client_staging_bytes=64 * layout.slot_bytes,
                                     shm_dir=workdir / "shm", workers=2, max_layouts=2, **SIZES)).start()


def fill_other(api: Any) -> None:
    """A named prefix 'other-docs' (5 blocks of OTHER, namespace t2, its manifest naming its
    layout) and 2 blocks of MV_B: another model's blocks in the second layout's store."""
    bs = OTHER.block_size
    docs, scope = tokens(11, 5 * bs), Scope(MV_O, "t2")
    for sc, toks in ((scope, docs), (Scope(MV_B), tokens(12, 2 * bs))):
        assert api.put(toks, pages_for(toks, sc, OTHER), sc).durable
    api.save_manifest("other-docs", {**manifest_for(docs, scope, OTHER), "namespace": "t2"})


class TwoLayoutTwins(Twins):
    def restart_daemon(self) -> None:
        workdir = self.runner.config.home.parent
        self.runner.stop()
        self.runner = run_two_layout_daemon(workdir, self.layout)


@pytest.fixture
def twins2(llama_dir, monkeypatch, tmp_path):
    """A home holding the model's layout at its root and OTHER under layouts/<id> (made
    here, as a daemon would), and a daemon serving both on a home of its own."""
    from tierkv.home import store_home
    from tierkv.hf import version_of

    monkeypatch.delenv("TIERKV_SOCKET", raising=False)
    monkeypatch.setenv("TIERKV_KEYS", str(tmp_path / "keys"))
    layout, mv = version_of(llama_dir)
    hdir, ddir = short_dir("tkvcli2-h-"), short_dir("tkvcli2-d-")
    home = hdir / "home"
    with tierkv.open(home, layout, device="cpu", shm_dir=hdir / "shm", **SIZES) as s:
        fill(s, layout, mv)
    assert store_home(home, OTHER) == home / "layouts" / "bfloat16-l3-h1-d32-b32"
    with tierkv.open(store_home(home, OTHER), OTHER, device="cpu", shm_dir=hdir / "shm", **SIZES) as s:
        fill_other(s)
    runner = run_two_layout_daemon(ddir, layout)
    t = TwoLayoutTwins(home, runner, llama_dir, layout, mv)
    try:
        with tierkv.connect(runner.socket, layout=layout) as c:
            fill(c, layout, mv)
        with tierkv.connect(runner.socket, layout=OTHER) as c:
            fill_other(c)
        t.restart_daemon()  # nothing in memory on either side
        yield t
    finally:
        t.runner.stop()
        remove(hdir)
        remove(ddir)


def test_home_commands_reach_every_layout_as_the_daemon_does(twins2):
    """Before: a --home command opened the root store only (the first layout), so stats,
    ls, invalidate, gc and verify missed the other layouts that --socket reaches."""
    from tierkv.home.directory import layout_id

    ids = {layout_id(twins2.layout), layout_id(OTHER)}
    s = twins2.same("stats", ignore=STATS_PER_PROCESS - {"layouts"})
    assert s["blocks"] == 13 + 7 and set(s["layouts"]) == ids
    assert s["layouts"][layout_id(OTHER)]["blocks"] == 7
    assert s["model_versions"] == {twins2.mv: 9, MV_B: 6, MV_O: 5}
    listing = twins2.same("ls")
    assert [p["name"] for p in listing["prefixes"]] == ["docs", "other-docs"]
    assert listing["prefixes"][1]["resident"]["disk"] == 5 and listing["prefixes"][1]["complete"]
    assert listing["layouts"][layout_id(OTHER)] == {"blocks": 7, "model_versions": {MV_O: 5, MV_B: 2}}
    assert run("ls", "--home", twins2.home).stdout == run("ls", "--socket", twins2.socket).stdout
    v = twins2.same("verify")
    assert v["ok"] and v["checked"] == 20 and v["integrity_error"] is None
    assert twins2.same("pin", "other-docs")["blocks"] == 5
    assert twins2.same("ls")["prefixes"][1]["pinned"] is True
    assert twins2.same("unpin", "other-docs")["blocks"] == 5
    assert twins2.same("invalidate", "--model-version", MV_B, "--dry-run")["removed_blocks"] == 6
    assert twins2.same("invalidate", "--namespace", "t2", "--dry-run")["removed_blocks"] == 5
    assert twins2.same("gc", "--dry-run")["removed_blocks"] == 3 + 6
    # A model directory names its own version under every layout it is served in (issue #32:
    # both failed through a daemon serving several layouts, "holds no tierkv store").
    by_model = twins2.same("invalidate", "--model", twins2.model_dir, "--dry-run")
    assert twins2.mv in by_model["model_versions"] and by_model["removed_blocks"] == s["model_versions"][twins2.mv]
    kept = twins2.same("gc", "--keep-model", twins2.model_dir, "--dry-run")
    assert kept["removed_blocks"] < 3 + 6 + 9
    # route picks the model's layout on a node serving two (before: the daemon node could
    # not answer a client that declared none).
    toks = twins2.home.parent / "docs.json"
    toks.write_text(json.dumps(tokens(1, 6 * twins2.layout.block_size).tolist()))  # the 'docs' prefix (fill)
    r = run_json("route", "--node", twins2.home, "--node", twins2.socket, "--tokens-file", toks, "--model",
                 twins2.model_dir)
    assert list(r["per_node"].values()) == [6 * twins2.layout.block_size] * 2 and not r["errors"]


def test_export_import_of_a_second_layout_prefix(twins2, tmp_path):
    out_h, out_s = tmp_path / "h.tkv", tmp_path / "s.tkv"
    a = run_json("export", "other-docs", "-o", out_h, "--home", twins2.home)
    b = run_json("export", "other-docs", "-o", out_s, "--socket", twins2.socket)
    assert drop(a) == drop(b) and a["blocks"] == 5
    twins2.restart_daemon()  # export leased the pages into the daemon's device tier
    twins2.same("invalidate", "--namespace", "t2")
    ih = run_json("import", out_s, "--home", twins2.home)
    isock = run_json("import", out_h, "--socket", twins2.socket)
    assert drop(ih) == drop(isock) and ih["stored_blocks"] == 5
    twins2.restart_daemon()
    assert twins2.same("ls")["prefixes"][1]["complete"]
