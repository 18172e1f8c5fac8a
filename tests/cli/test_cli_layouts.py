"""Issue #37, item 2: a typo must not make a layout forever. `generate --prefix` of an
unknown name or another block size is an error naming what differs, before any store opens;
a model whose layout the home (or daemon) lacks needs --new-layout; `tierkv layouts` lists
the layouts and `tierkv layouts rm` removes one (through a daemon its budget share returns
to the others)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import tierkv
from tierkv.cli import main
from tierkv.home.directory import find_layouts, layout_id
from tierkv.hf import version_of

pytestmark = pytest.mark.usefixtures("private_caches")

PROMPT = "store the block and read it back from the disk tier " * 4  # several blocks of 16 and 32


@pytest.fixture(autouse=True)
def _no_daemon_from_env(monkeypatch):
    monkeypatch.delenv("TIERKV_SOCKET", raising=False)
    monkeypatch.delenv("TIERKV_HOME", raising=False)


def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    else:
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    return result


def run_json(*args) -> dict:
    return json.loads(run(*args, "--json").stdout.strip().splitlines()[-1])


def test_a_typo_through_home_makes_no_layout_and_rm_removes_one(llama_dir, repo, tmp_path):
    home = tmp_path / "home"
    run("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress")
    ask = ("--model", llama_dir, "--prompt", PROMPT, "--max-new-tokens", "2", "--no-progress", "--home", home)
    # An unknown name: the known ones are listed, no store is made for anything.
    err = run("generate", *ask, "--prefix", "rep0", ok=False).stderr
    assert "no prefix named 'rep0' (known: repo)" in err
    # The right name with another block size: the block size is named, not another model.
    err = run("generate", *ask, "--prefix", "repo", "--block-size", "32", ok=False).stderr
    assert "block size 32 (not 16)" in err and "--block-size 16" in err and "model version" not in err
    # Another dtype through --prefix (the issue's `--dtype bfloat16`): the dtype is named.
    err = run("generate", *ask, "--prefix", "repo", "--dtype", "bfloat16", ok=False).stderr
    assert "dtype bfloat16 (not float32)" in err and "--dtype float32" in err
    # No prefix, another block size: an error naming it and --new-layout.
    err = run("generate", *ask, "--block-size", "32", ok=False).stderr
    assert "block size 32 (not 16)" in err and "--new-layout" in err
    assert len(find_layouts(home)) == 1 and not (home / "layouts").exists()
    # A home without any store: an unknown prefix creates nothing.
    empty = tmp_path / "empty"
    assert "holds no tierkv store" in run("generate", *ask[:-1], empty, "--prefix", "x", ok=False).stderr
    assert not empty.exists()

    # Asked for: a second layout, listed with its block size.
    run("generate", *ask, "--block-size", "32", "--new-layout")
    listed = run_json("layouts", "--home", home)["layouts"]
    assert [(r["block_size"], r["dtype"]) for r in listed] == [(16, "float32"), (32, "float32")]
    assert listed[0]["prefixes"] == ["repo"] and listed[1]["blocks"] > 0 and listed[1]["prefixes"] == []
    b32 = listed[1]["layout_id"]
    table = run("layouts", "ls", "--home", home).stdout
    assert b32 in table and "repo" in table
    # rm: refused without --yes while it holds blocks; unknown ids are named.
    assert "pass --yes" in run("layouts", "rm", b32, "--home", home, ok=False).stderr
    assert "no layout nope (known: " in run("layouts", "rm", "nope", "--home", home, ok=False).stderr
    removed = run_json("layouts", "rm", b32, "--yes", "--home", home)
    assert removed["layout_id"] == b32 and removed["removed_blocks"] == listed[1]["blocks"]
    assert [lo.block_size for _, lo in find_layouts(home)] == [16]
    assert not (home / "layouts" / b32).exists() and not list(home.glob(".removed-*"))
    # The home still works, and the removed layout can come back when asked.
    assert run_json("generate", *ask, "--prefix", "repo")["cached_tokens"] > 0
    with tierkv.open(home, find_layouts(home)[0][1]) as st:
        st.check_integrity()


def test_removing_the_root_layout_keeps_the_others(llama_dir, repo, tmp_path):
    home = tmp_path / "home"
    run("materialize", repo, "--model", llama_dir, "--home", home, "--name", "a", "--no-progress")
    run("materialize", repo, "--model", llama_dir, "--home", home, "--name", "b", "--no-progress",
        "--block-size", "32", "--new-layout")
    root_id = layout_id(find_layouts(home)[0][1])
    run("layouts", "rm", root_id, "--yes", "--home", home)
    assert [lo.block_size for _, lo in find_layouts(home)] == [32]
    assert not (home / "index").exists() and not (home / "segments").exists()
    out = run_json("generate", "--model", llama_dir, "--prompt", "x", "--max-new-tokens", "1", "--no-progress",
                   "--home", home, "--prefix", "b", "--block-size", "32")
    assert out["cached_tokens"] > 0


@pytest.fixture
def daemon(llama_dir):
    """`tierkv serve`'s Daemon from a thread, serving a fresh home with the model's layout;
    yields a function that (re)starts it and the config."""
    from helpers.daemons import DaemonThread
    from tierkv.daemon.config import DaemonConfig
    from tierkv.daemon.server import Daemon

    layout, _ = version_of(llama_dir)
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvlo-"))  # AF_UNIX paths are short
    cfg = DaemonConfig(home=d / "home", socket=d / "d.sock", layout=layout, device="cpu",
                       device_bytes=64 << 20, host_bytes=16 << 20, disk_bytes=256 << 20, shm_dir=d / "shm",
                       workers=2, max_layouts=4)
    running: list[DaemonThread] = []

    def start() -> Daemon:
        running.append(DaemonThread(cfg).start())
        return running[-1].daemon

    def stop() -> None:
        running.pop().stop()

    try:
        yield start, stop, cfg
    finally:
        while running:
            stop()
        shutil.rmtree(d, ignore_errors=True)


def test_a_typo_through_a_daemon_keeps_the_budgets_and_rm_gives_them_back(llama_dir, repo, daemon):
    start, stop, cfg = daemon
    start()
    sock = ("--socket", cfg.socket)
    run("materialize", repo, "--model", llama_dir, *sock, "--name", "repo", "--no-progress")
    full = run_json("stats", *sock)["tiers"]
    ask = ("--model", llama_dir, "--prompt", PROMPT, "--max-new-tokens", "2", "--no-progress", *sock)
    err = run("generate", *ask, "--prefix", "repo", "--block-size", "32", ok=False).stderr
    assert "block size 32 (not 16)" in err and "--block-size 16" in err
    err = run("generate", *ask, "--block-size", "32", ok=False).stderr
    assert "the daemon at" in err and "block size 32 (not 16)" in err and "--new-layout" in err
    # Nothing opened: one layout, its tiers at the whole budgets (the issue: halved, for good).
    s = run_json("stats", *sock)
    assert list(s["layouts"]) == [layout_id(version_of(llama_dir)[0])]
    assert {t: s["tiers"][t]["capacity_bytes"] for t in full} == {t: full[t]["capacity_bytes"] for t in full}

    run("generate", *ask, "--block-size", "32", "--new-layout")
    two = run_json("layouts", *sock)["layouts"]
    assert [r["block_size"] for r in two] == [16, 32]
    assert two[0]["limit_bytes"]["disk"] == full["disk"]["capacity_bytes"] // 2
    b32 = two[1]["layout_id"]
    # In use by a client of that layout: refused, even with --yes.
    with tierkv.connect(cfg.socket, layout=version_of(llama_dir, block_size=32)[0]):
        assert "used by 1 connection" in run("layouts", "rm", b32, "--yes", *sock, ok=False).stderr
    removed = run_json("layouts", "rm", b32, "--yes", *sock)
    assert removed["removed_blocks"] == two[1]["blocks"] > 0
    one = run_json("layouts", *sock)["layouts"]
    assert [r["layout_id"] for r in one] == [two[0]["layout_id"]]
    assert one[0]["limit_bytes"] == {t: full[t]["capacity_bytes"] for t in ("device", "host", "disk")}
    assert not (cfg.home / "layouts" / b32).exists()
    assert run_json("generate", *ask, "--prefix", "repo")["cached_tokens"] > 0
    # Gone for good: a restarted daemon finds one layout.
    stop()
    start()
    assert [r["block_size"] for r in run_json("layouts", *sock)["layouts"]] == [16]


def test_removing_the_root_layout_through_a_daemon_keeps_the_home_locked(llama_dir, repo, daemon):
    """The daemon holds HOME/LOCK for its life (issue 34, item 4) and lends it to the root's
    store: removing that store leaves the home locked, and the next new layout opens at the
    root."""
    from tierkv.errors import DaemonOwnsHomeError

    start, stop, cfg = daemon
    start()
    sock = ("--socket", cfg.socket)
    run("materialize", repo, "--model", llama_dir, *sock, "--name", "repo", "--no-progress")
    ask = ("--model", llama_dir, "--prompt", PROMPT, "--max-new-tokens", "1", "--no-progress", *sock)
    run("generate", *ask, "--block-size", "32", "--new-layout")
    root_id = layout_id(version_of(llama_dir)[0])
    run_json("layouts", "rm", root_id, "--yes", *sock)
    assert [r["block_size"] for r in run_json("layouts", *sock)["layouts"]] == [32]
    assert not (cfg.home / "index").exists()
    with pytest.raises(DaemonOwnsHomeError):
        tierkv.open(cfg.home, version_of(llama_dir)[0])
    run("generate", *ask, "--block-size", "64", "--new-layout")  # opens at the root
    assert tierkv.home_layout(cfg.home).block_size == 64
    stop()
    start()
    # Both found again (16 too: the fixture's daemon has it as its --layout), 64 at the root.
    assert sorted(r["block_size"] for r in run_json("layouts", *sock)["layouts"]) == [16, 32, 64]
    assert tierkv.home_layout(cfg.home).block_size == 64


def test_invalidate_and_gc_of_a_model_through_a_daemon_serving_several_layouts(llama_dir, repo, daemon):
    """`invalidate --model M --socket S` and `gc --keep-model M --socket S` failed ("holds
    no tierkv store") when the daemon served several layouts: the model's version was taken
    under the local default home's layout. It is taken under every layout the daemon
    serves: the model's blocks under each are found, kept or removed."""
    start, stop, cfg = daemon
    start()
    sock = ("--socket", cfg.socket)
    run("materialize", repo, "--model", llama_dir, *sock, "--name", "b16", "--no-progress")
    run("materialize", repo, "--model", llama_dir, *sock, "--name", "b32", "--no-progress", "--block-size", "32",
        "--new-layout")
    per = run_json("stats", *sock)["layouts"]
    blocks = {lid: s["blocks"] for lid, s in per.items()}
    assert len(blocks) == 2 and all(blocks.values())
    kept = run_json("gc", "--keep-model", llama_dir, "--dry-run", *sock)
    assert kept["removed_blocks"] == 0 and len(kept["kept_model_versions"]) == 2
    dry = run_json("invalidate", "--model", llama_dir, "--dry-run", *sock)
    assert dry["removed_blocks"] == sum(blocks.values()) and len(dry["model_versions"]) == 2
    done = run_json("invalidate", "--model", llama_dir, *sock)
    assert done["removed_blocks"] == sum(blocks.values())
    assert all(s["blocks"] == 0 for s in run_json("stats", *sock)["layouts"].values())
