"""The operations CLI (tierkv/cli/ops.py) driven through click's CliRunner on a real store
built here: random pages put under manifests shaped like the ones `materialize` writes."""
from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Priority, Scope, block_keys
from tierkv.cli import main
from tierkv.model_version import model_version
from tierkv.tiers.segments import read_header

LAYOUT = PageLayout(2, 2, 8, block_size=4)
MV_A = hashlib.sha256(b"model a").hexdigest()
MV_B = hashlib.sha256(b"model b").hexdigest()
MV_C = hashlib.sha256(b"model c").hexdigest()
SMALL = {"device": "cpu", "device_bytes": 8 * LAYOUT.page_bytes, "host_bytes": 0, "disk_bytes": 64 << 20}


# ---- building a home ---------------------------------------------------------------------
def open_home(home: Path, **options) -> tierkv.Store:
    return tierkv.open(home, LAYOUT, **{**SMALL, **options})


def random_tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int64).astype("<i4")


def random_pages(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.shape), generator=g, dtype=LAYOUT.torch_dtype)


def put_prefix(store, tokens: np.ndarray, scope: Scope, seed: int, priority: Priority = Priority.NORMAL,
               chunk: int = 4) -> torch.Tensor:
    n = len(tokens) // LAYOUT.block_size
    pages = random_pages(n, seed)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        r = store.put(tokens[: end * LAYOUT.block_size], pages[start:end], scope, start_block=start, priority=priority)
        assert r.durable
    return pages


def manifest_for(tokens: np.ndarray, scope: Scope, pinned: bool = False) -> dict:
    """The fields tierkv.materialize.build_manifest writes (no namespace field, like it)."""
    keys = block_keys(tokens, scope, LAYOUT.block_size)
    return {
        "kind": "prefix", "format": 1, "model_version": scope.model_version, "model_dir": "/models/x",
        "layout": LAYOUT.to_dict(), "tokens": len(tokens), "blocks": len(keys),
        "last_block_key": keys[-1].hex() if keys else None,
        "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(), "document_sha256": "0" * 64,
        "roots": ["/src"], "options": {}, "max_tokens": None, "sources": [], "pinned": pinned,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def add_named(store, name: str, tokens: np.ndarray, scope: Scope, seed: int, pinned: bool = False) -> torch.Tensor:
    pages = put_prefix(store, tokens, scope, seed, Priority.PINNED if pinned else Priority.NORMAL)
    store.save_manifest(name, manifest_for(tokens, scope, pinned))
    return pages


def fake_model_dir(path: Path, salt: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "salt": salt}))
    (path / "model.safetensors").write_bytes(salt.encode() * 100)
    return path


@pytest.fixture(autouse=True)
def _no_daemon_from_env(monkeypatch):
    monkeypatch.delenv("TIERKV_SOCKET", raising=False)


@pytest.fixture
def home(tmp_path) -> Path:
    """A home with prefix 'docs' (model A, 6 blocks), 'tenant' (model A, namespace t1, 3
    blocks, no manifest) and 4 blocks of model B without a manifest."""
    h = tmp_path / "home"
    with open_home(h) as s:
        add_named(s, "docs", random_tokens(24, 1), Scope(MV_A), seed=1)
        put_prefix(s, random_tokens(12, 2), Scope(MV_A, "t1"), seed=2)
        put_prefix(s, random_tokens(16, 3), Scope(MV_B), seed=3)
    return h


def run(*args: str, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def run_json(*args: str, ok: bool = True) -> dict:
    result = run(*args, "--json", ok=ok)
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(home: Path) -> dict:
    """Reopen the home, check its integrity, return its stats."""
    with open_home(home) as s:
        s.check_integrity()
        return s.stats()


def segment_versions(home: Path) -> list[str]:
    return sorted(read_header(p).model_version for p in (home / "segments").glob("seg-*.safetensors"))


# ---- invalidate --------------------------------------------------------------------------
def test_invalidate_model_version_dry_run_then_removes_and_is_idempotent(home):
    assert MV_B in segment_versions(home)
    dry = run_json("invalidate", "--home", home, "--model-version", MV_B, "--dry-run")
    assert dry["removed_blocks"] == 4 and dry["freed_bytes"] > 0 and dry["dry_run"]
    assert check(home)["model_versions"][MV_B] == 4

    out = run_json("invalidate", "--home", home, "--model-version", MV_B)
    assert out == {**dry, "dry_run": False}
    stats = check(home)
    assert MV_B not in stats["model_versions"] and stats["model_versions"][MV_A] == 9
    assert MV_B not in segment_versions(home)  # its segment file was deleted

    again = run_json("invalidate", "--home", home, "--model-version", MV_B)
    assert again["removed_blocks"] == 0 and again["freed_bytes"] == 0


def test_invalidate_namespace(home):
    out = run_json("invalidate", "--home", home, "--namespace", "t1")
    assert out["removed_blocks"] == 3 and out["freed_bytes"] > 0
    stats = check(home)
    assert "t1" not in stats["namespaces"] and stats["model_versions"][MV_A] == 6


def test_invalidate_model_dir_uses_the_home_layout(home, tmp_path):
    model = fake_model_dir(tmp_path / "model", "m")
    mv = model_version(model, LAYOUT)
    with open_home(home) as s:
        put_prefix(s, random_tokens(20, 9), Scope(mv), seed=9)
    out = run_json("invalidate", "--home", home, "--model", model)
    assert out["model_version"] == mv and out["removed_blocks"] == 5
    assert mv not in check(home)["model_versions"]


def test_invalidate_human_output_and_usage_errors(home):
    assert "blocks removed" in run("invalidate", "--home", home, "--namespace", "nobody").output
    assert run("invalidate", "--home", home, ok=False).exit_code == 2
    bad = run("invalidate", "--home", home, "--model-version", "abc", ok=False)
    assert bad.exit_code == 2 and "64 hex" in bad.output


def test_missing_home_is_a_clear_error(tmp_path):
    r = run("stats", "--home", tmp_path / "nothing", ok=False)
    assert r.exit_code == 1 and "holds no tierkv store" in r.output


def test_socket_without_a_daemon_is_a_clear_error(home, tmp_path):
    r = CliRunner().invoke(main, ["ls", "--socket", str(tmp_path / "no.sock")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert "socket" in r.output.lower() or "daemon" in r.output.lower()


# ---- stats / ls ----------------------------------------------------------------------------
def test_stats_json_and_table(home):
    s = run_json("stats", "--home", home)
    for tier in ("device", "host", "disk"):
        assert {"blocks", "used_bytes", "capacity_bytes"} <= set(s["tiers"][tier])
    assert s["tiers"]["disk"]["blocks"] == 13 and s["blocks"] == 13
    for key in ("hit_rate_by_tier", "promoted_bytes", "demoted_bytes", "evictions", "quarantined",
                "lookups_per_s", "disk_read_path"):
        assert key in s
    text = run("stats", "--home", home).output
    assert "disk read path" in text and "hit rate" in text and "device" in text


def test_ls_lists_prefixes_with_residency(home):
    out = run_json("ls", "--home", home)
    (docs,) = out["prefixes"]
    assert docs["name"] == "docs" and docs["tokens"] == 24 and docs["model_version"] == MV_A
    assert docs["resident"]["blocks"] == 6 and docs["resident"]["disk"] == 6 and docs["complete"]
    assert not docs["pinned"]
    assert out["model_versions"] == {MV_A: 9, MV_B: 4}
    assert out["namespaces"] == {"default": 10, "t1": 3}
    text = run("ls", "--home", home).output
    assert "docs" in text and MV_A[:12] in text and "t1" in text


# ---- pin / unpin ---------------------------------------------------------------------------
def test_pin_survives_eviction_pressure_and_unpin_releases(tmp_path):
    h = tmp_path / "home"
    tight = {"disk_bytes": 12 * LAYOUT.slot_bytes, "segment_pages": 4}
    tokens = random_tokens(16, 5)
    with open_home(h, **tight) as s:
        add_named(s, "keep", tokens, Scope(MV_A), seed=5)
    out = run_json("pin", "keep", "--home", h)
    assert out == {"name": "keep", "pinned": True, "blocks": 4, "expected_blocks": 4}
    assert run_json("ls", "--home", h)["prefixes"][0]["pinned"]
    last = bytes.fromhex(manifest_for(tokens, Scope(MV_A))["last_block_key"])

    with open_home(h, **tight) as s:
        for seed in range(10, 16):  # 24 more blocks through a disk tier of 12 slots
            put_prefix(s, random_tokens(16, seed), Scope(MV_A), seed=seed)
        assert s.chain_residency(last).disk == 4
        assert s.stats()["evictions"]["disk"] > 0
        s.check_integrity()

    assert run_json("unpin", "keep", "--home", h)["pinned"] is False
    with open_home(h, **tight) as s:
        assert s.get_manifest("keep")["pinned"] is False
        for seed in range(20, 26):
            put_prefix(s, random_tokens(16, seed), Scope(MV_A), seed=seed)
        assert s.chain_residency(last).disk < 4


def test_pin_unknown_name(home):
    r = run("pin", "nope", "--home", home, ok=False)
    assert r.exit_code == 1 and "no prefix named 'nope'" in r.output


# ---- verify --------------------------------------------------------------------------------
def flip_page_byte(home: Path, model_version: str, index: int = 0, offset: int = 17) -> None:
    """Flip one byte inside page slot ``index`` of the segment of ``model_version``."""
    for p in sorted((home / "segments").glob("seg-*.safetensors")):
        header = read_header(p)
        if header.model_version == model_version:
            with open(p, "r+b") as f:
                pos = header.data_offset + index * LAYOUT.slot_bytes + offset  # after the slot records
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ 0xFF]))
            return
    raise AssertionError("no segment of that model version")


def test_verify_finds_a_flipped_byte_and_repair_quarantines_it(home):
    clean = run_json("verify", "--home", home)
    assert clean["ok"] and clean["checked"] == 13 and clean["corrupt"] == []

    flip_page_byte(home, MV_B)
    found = run_json("verify", "--home", home, ok=False)
    assert found["corrupt"] and len(found["corrupt"]) == 1 and not found["ok"]
    assert run("verify", "--home", home, ok=False).exit_code == 1

    repaired = run_json("verify", "--home", home, "--repair")
    assert repaired["ok"] and repaired["repaired"] and repaired["corrupt"] == found["corrupt"]
    after = run_json("verify", "--home", home)
    assert after["ok"] and after["corrupt"] == [] and after["checked"] == 12
    assert after["integrity_checked"] and after["integrity_error"] is None
    assert check(home)["blocks"] == 12


# ---- gc ------------------------------------------------------------------------------------
def test_gc_keeps_named_and_kept_scopes_and_drops_dead_manifests(home, tmp_path):
    model = fake_model_dir(tmp_path / "model", "c")
    mv_model = model_version(model, LAYOUT)
    with open_home(home) as s:
        put_prefix(s, random_tokens(8, 30), Scope(MV_C), seed=30)  # kept by --keep-model-version
        put_prefix(s, random_tokens(8, 31), Scope(mv_model), seed=31)  # kept by --keep-model
        # A prefix in namespace t2 whose manifest has no namespace field: gc reads it from the chain.
        t2 = random_tokens(8, 32)
        add_named(s, "t2docs", t2, Scope(MV_B, "t2"), seed=32)
        # Prefixes whose blocks are all gone already: one that records its namespace (as
        # import writes), one in the default namespace of a model version with no blocks left.
        add_named(s, "gone", random_tokens(8, 33), Scope(MV_C, "old"), seed=33)
        s.save_manifest("gone", {**s.get_manifest("gone"), "namespace": "old"})
        s.invalidate(namespace="old")
        mv_d = hashlib.sha256(b"model d").hexdigest()
        add_named(s, "gone2", random_tokens(8, 34), Scope(mv_d), seed=34)
        s.invalidate(model_version=mv_d)
    before = check(home)

    dry = run_json("gc", "--home", home, "--dry-run", "--keep-model-version", MV_C, "--keep-model", model)
    removed = {(r["model_version"], r["namespace"]): r["blocks"] for r in dry["removed"]}
    assert removed == {(MV_A, "t1"): 3, (MV_B, "default"): 4}
    assert dry["deleted_manifests"] == ["gone", "gone2"] and dry["removed_blocks"] == 7 and dry["freed_bytes"] > 0
    after = check(home)
    for key in ("blocks", "model_versions", "namespaces"):
        assert after[key] == before[key]
    assert len(run_json("ls", "--home", home)["prefixes"]) == 4

    out = run_json("gc", "--home", home, "--keep-model-version", MV_C, "--keep-model", model)
    assert {k: v for k, v in out.items() if k != "dry_run"} == {k: v for k, v in dry.items() if k != "dry_run"}
    stats = check(home)
    assert stats["model_versions"] == {MV_A: 6, MV_B: 2, MV_C: 2, mv_model: 2}
    names = [p["name"] for p in run_json("ls", "--home", home)["prefixes"]]
    assert names == ["docs", "t2docs"]
    assert run_json("gc", "--home", home, "--keep-model-version", MV_C, "--keep-model", model)["removed_blocks"] == 0

    # Without --keep-*, only what named prefixes use stays.
    run_json("gc", "--home", home)
    assert check(home)["model_versions"] == {MV_A: 6, MV_B: 2}
    assert "blocks removed" in run("gc", "--home", home).output


# ---- export / import ------------------------------------------------------------------------
@pytest.fixture
def exported(home, tmp_path):
    with open_home(home) as s:
        s.set_priority_from(bytes.fromhex(s.get_manifest("docs")["last_block_key"]), Priority.PINNED)
        m = s.get_manifest("docs")
        s.save_manifest("docs", {**m, "pinned": True})
    path = tmp_path / "docs.tkv"
    out = run_json("export", "docs", "-o", path, "--home", home)
    assert out["blocks"] == 6 and out["tokens"] == 24 and out["file_bytes"] == path.stat().st_size
    return path


def test_export_import_round_trip_is_byte_identical(home, exported, tmp_path):
    fresh = tmp_path / "fresh"
    out = run_json("import", exported, "--home", fresh)
    assert out["name"] == "docs" and out["stored_blocks"] == 6 and out["durable"]
    tokens = random_tokens(24, 1)
    with open_home(home) as s:
        with s.acquire(tokens, Scope(MV_A)) as lease:
            original = lease.pages().clone()
    with open_home(fresh) as f:
        with f.acquire(tokens, Scope(MV_A)) as lease:
            assert lease.num_blocks == 6
            assert torch.equal(lease.pages().view(torch.uint8), original.view(torch.uint8))
        m = f.get_manifest("docs")
        assert m["pinned"] and m["last_block_key"] == manifest_for(tokens, Scope(MV_A))["last_block_key"]
        f.check_integrity()
    ls = run_json("ls", "--home", fresh)["prefixes"][0]
    assert ls["pinned"] and ls["complete"]

    # Importing again is harmless; under another name too.
    again = run_json("import", exported, "--home", fresh, "--name", "docs2")
    assert again["stored_blocks"] == 0 and again["skipped_blocks"] == 6


@pytest.mark.parametrize("damage", ["flip", "truncate", "not-a-bundle"])
def test_import_refuses_a_damaged_bundle(exported, tmp_path, damage):
    data = bytearray(exported.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 200]
    else:
        data = bytearray(b"hello, not a bundle" * 10)
    bad = tmp_path / "bad.tkv"
    bad.write_bytes(bytes(data))
    fresh = tmp_path / "fresh"
    r = run("import", bad, "--home", fresh, ok=False)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert any(w in r.output for w in ("damaged", "truncated", "checksum", "not a tierkv bundle")), r.output
    assert not (fresh / "index").exists()  # refused before a home was created


def test_import_refuses_another_model_version_unless_forced(exported, tmp_path):
    other = fake_model_dir(tmp_path / "other", "other")
    fresh = tmp_path / "fresh"
    r = run("import", exported, "--home", fresh, "--model", other, ok=False)
    assert r.exit_code == 1 and "model version" in r.output
    assert not (fresh / "index").exists()
    out = run_json("import", exported, "--home", fresh, "--model", other, "--force")
    assert out["stored_blocks"] == 6 and out["model_version"] == MV_A


def test_import_refuses_another_layout_and_a_taken_name(exported, tmp_path):
    other_home = tmp_path / "other-layout"
    tierkv.open(other_home, PageLayout(2, 2, 8, block_size=8), device="cpu", host_bytes=0).close()
    r = run("import", exported, "--home", other_home, ok=False)
    assert r.exit_code == 1 and "layout" in r.output

    fresh = tmp_path / "fresh"
    with open_home(fresh) as s:
        add_named(s, "docs", random_tokens(8, 40), Scope(MV_A), seed=40)
    r = run("import", exported, "--home", fresh, ok=False)
    assert r.exit_code == 1 and "already named" in r.output
    assert run_json("import", exported, "--home", fresh, "--force")["replaced_manifest"]


def test_export_of_an_incomplete_prefix_is_refused(home, tmp_path):
    with open_home(home) as s:
        s.invalidate(model_version=MV_A)
    r = run("export", "docs", "-o", tmp_path / "x.tkv", "--home", home, ok=False)
    assert r.exit_code == 1 and "not stored" in r.output
    assert not (tmp_path / "x.tkv").exists()


# ---- through a daemon (--socket) ---------------------------------------------------------------
@pytest.fixture
def daemon_socket():
    """A daemon serving a fresh home from a thread of this process; yields its socket path."""
    from helpers.daemons import DaemonThread
    from tierkv.daemon.config import DaemonConfig

    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvops-"))  # AF_UNIX paths are short
    cfg = DaemonConfig(home=d / "home", socket=d / "d.sock", layout=LAYOUT, device="cpu",
                       device_bytes=64 * LAYOUT.page_bytes, host_bytes=1 << 20, disk_bytes=16 << 20,
                       staging_bytes=256 << 10, client_staging_bytes=64 << 10, shm_dir=d / "shm", workers=2)
    with DaemonThread(cfg):
        yield cfg.socket
    shutil.rmtree(d, ignore_errors=True)


def test_commands_through_a_daemon(daemon_socket):
    with tierkv.connect(daemon_socket) as c:
        put_prefix(c, random_tokens(16, 50), Scope(MV_A), seed=50)
        put_prefix(c, random_tokens(8, 51), Scope(MV_B), seed=51)
        c.save_manifest("docs", manifest_for(random_tokens(16, 50), Scope(MV_A)))
    sock = ("--socket", daemon_socket)
    s = run_json("stats", *sock)
    assert s["model_versions"] == {MV_A: 4, MV_B: 2} and s["tiers"]["disk"]["blocks"] == 6
    assert run_json("verify", *sock)["ok"]
    assert run_json("invalidate", "--model-version", MV_B, "--dry-run", *sock)["removed_blocks"] == 2
    assert run_json("invalidate", "--model-version", MV_B, *sock)["removed_blocks"] == 2
    assert run_json("stats", *sock)["model_versions"] == {MV_A: 4}
    # Every command works through the daemon (tests/conformance/test_cli.py compares each
    # one's output with --home); here the ones that walk a chain.
    assert run_json("ls", *sock)["prefixes"][0]["resident"]["blocks"] == 4
    assert run_json("pin", "docs", *sock)["blocks"] == 4
    assert run_json("gc", "--dry-run", *sock)["removed_blocks"] == 0


def test_an_explicit_home_beats_TIERKV_SOCKET_and_two_explicit_targets_are_an_error(home, daemon_socket, monkeypatch):
    """Issue #37, item 1: with TIERKV_SOCKET in the environment, `invalidate --home h1`
    counted (and would have removed) the daemon's blocks."""
    with tierkv.connect(daemon_socket) as c:
        put_prefix(c, random_tokens(8, 60), Scope(MV_B), seed=60)  # the daemon's home: 2 blocks of B
    monkeypatch.setenv("TIERKV_SOCKET", str(daemon_socket))
    # The explicit --home is the target, not the daemon named by the environment.
    assert run_json("invalidate", "--home", home, "--model-version", MV_B, "--dry-run")["removed_blocks"] == 4
    assert run_json("stats", "--home", home)["home"] == str(home)
    # Without --home (or with TIERKV_HOME only) the environment's socket is the target.
    daemon_stats = run_json("stats")
    assert daemon_stats["model_versions"] == {MV_B: 2} and "daemon" in daemon_stats
    monkeypatch.setenv("TIERKV_HOME", str(home))
    assert run_json("invalidate", "--model-version", MV_B, "--dry-run")["removed_blocks"] == 2
    # An explicit --socket beats TIERKV_HOME.
    monkeypatch.delenv("TIERKV_SOCKET")
    assert run_json("invalidate", "--socket", daemon_socket, "--model-version", MV_B, "--dry-run")["removed_blocks"] == 2
    # Two explicit targets: a usage error naming both, and nothing done to either.
    r = run("invalidate", "--home", home, "--socket", daemon_socket, "--model-version", MV_B, ok=False)
    assert r.exit_code == 2 and "--home" in r.output and "--socket" in r.output and "both" in r.output
    assert check(home)["model_versions"][MV_B] == 4
    assert run_json("stats", "--socket", daemon_socket)["model_versions"] == {MV_B: 2}


def test_verify_repair_with_home_rebuilds_a_damaged_index_of_any_layout(tmp_path):
    """A home with two layouts (as a daemon serving two models makes it): --home commands
    cover both stores, and verify --repair rebuilds the second layout's index too."""
    import os

    from tierkv.home import store_home

    home, shm = tmp_path / "home", tmp_path / "shm"
    a = PageLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
    b = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
    scope = Scope("ab" * 32, "n")
    for lo, n in ((a, 3), (b, 2)):
        toks = np.arange(n * lo.block_size, dtype=np.int32)
        with tierkv.open(store_home(home, lo), lo, device="cpu", host_bytes=0, disk_bytes=8 << 20,
                          shm_dir=shm) as st:
            st.put(toks, torch.randn((n, *lo.shape)).to(lo.torch_dtype), scope)
    assert store_home(home, b) != home and store_home(home, a) == home

    def run(*args):
        return CliRunner().invoke(main, [*args, "--home", str(home), "--json"])

    r = run("stats")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["blocks"] == 5  # before: the root store's 3 only
    data = store_home(home, b) / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    assert run("verify").exit_code != 0  # the damaged layout is not skipped
    r = run("verify", "--repair")
    assert r.exit_code == 0, r.output + repr(r.exception)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["checked"] == 5 and out["index_rebuilt"] is None
    assert [x["rebuilt"] for x in out["layouts_rebuilt"].values()] == [2]
