"""Every CLI command with ``--home`` and with ``--socket``, on one page layout: the same
store contents behind each (a home opened by the command, a daemon serving its own home),
the same ``--json`` (the twins: cli_kit.py; two layouts: test_cli_two_layouts.py).
"""
from __future__ import annotations

import pytest

from .cli_kit import MV_B, STATS_PER_PROCESS, drop, run, run_json

pytestmark = pytest.mark.usefixtures("private_caches")


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
