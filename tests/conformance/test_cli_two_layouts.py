"""Every CLI command that takes ``--home``/``--socket``, against a home and a daemon that
both hold two page layouts (issue #32: "every CLI command gives the same --json through
--home and through a daemon serving two layouts"): the whole ``--json`` compared, after
dropping the fields that differ by nature (cli_kit.py: TIMINGS, STATS_PER_PROCESS).

Commands that take ``--home``/``--socket`` but are not compared here, by nature:
``serve`` is the daemon itself; ``doctor`` and ``config show`` describe a deployment (the
budgets and settings of the daemon live on the socket, else the local ones), not a store's
contents; ``quickstart`` takes ``--home`` only (its demo model has a store of its own).
``model-version`` and ``route`` take neither: ``model-version`` reads a model directory
only, and ``route`` is given both sides as nodes (compared below).

Differences by nature, each where it shows: the daemon keeps the pages a command read or
stored in its memory tiers (it is restarted before residency is compared); a layout's
limits (LIMITS); an error naming its target (the home's path, or "the daemon at" its
socket); a home with no store left (test_layouts_ls_and_rm); and ``--new-layout`` beyond
the daemon's ``max_layouts`` (2 here), a setting a home opened by a command does not have.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_models

from tierkv.hf import version_of
from tierkv.home.directory import layout_id

from .cli_kit import MV_B, MV_O, OTHER, STATS_PER_PROCESS, Twins, drop, run, run_json, tokens

pytestmark = pytest.mark.usefixtures("private_caches")
# A layout's limits are the defaults of a home the command opens, and the daemon's share of
# its budgets (the per-layout form of STATS_PER_PROCESS's capacity_bytes).
LIMITS = {"limit_bytes"}


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """A model whose page layout (at --block-size 32) is OTHER, the twins' second layout."""
    path = tiny_models.save_model_dir(tmp_path_factory.mktemp("models") / "other", "llama", dtype=torch.bfloat16,
                                      layers=3, hidden=64, heads=2, kv_heads=1)
    assert version_of(path, block_size=32)[0] == OTHER
    return path


def same_lines(t: Twins, *args: object, input: str) -> list[dict]:
    """Every --json line of a command that prints one per step (chat: one per turn)."""
    out = []
    for flag, target in (("--home", t.home), ("--socket", t.socket)):
        lines = run(*args, "--json", flag, target, input=input).stdout.strip().splitlines()
        out.append([drop(json.loads(line)) for line in lines])
    assert out[0] == out[1], f"{args}: --home gave {out[0]}, --socket gave {out[1]}"
    return out[0]


def same_error(t: Twins, *args: object) -> str:
    """The command fails alike through both: exit status and message."""
    a = run(*args, "--home", t.home, ok=False)
    b = run(*args, "--socket", t.socket, ok=False)
    assert (a.exit_code, a.output) == (b.exit_code, b.output) and a.exit_code != 0, (a.output, b.output)
    return a.output


def test_home_commands_reach_every_layout_as_the_daemon_does(twins2):
    """Before: a --home command opened the root store only (the first layout), so stats,
    ls, invalidate, gc and verify missed the other layouts that --socket reaches."""
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


def test_removals_through_two_layouts(twins2):
    """invalidate --model, gc --keep-model and verify --repair for real (the dry runs
    above), then what is left, through both."""
    by_model = twins2.same("invalidate", "--model", twins2.model_dir)
    assert by_model["removed_blocks"] == 9 and not by_model["dry_run"]
    s = twins2.same("stats", ignore=STATS_PER_PROCESS - {"layouts"})
    assert s["model_versions"] == {MV_B: 6, MV_O: 5} and s["layouts"][layout_id(twins2.layout)]["blocks"] == 4
    kept = twins2.same("gc", "--keep-model", twins2.model_dir, "--keep-namespace", "t2")
    # Nothing of the model is left to keep; t2 keeps other-docs' chain, MV_B's blocks go.
    assert kept["removed_blocks"] == 6 and [twins2.mv, "t2"] not in kept["kept_scopes"]
    repaired = twins2.same("verify", "--repair")
    assert repaired["ok"] and repaired["checked"] == 5 and repaired["corrupt"] == []
    listing = twins2.same("ls")
    assert [(p["name"], p["complete"]) for p in listing["prefixes"]] == [("other-docs", True)]  # docs went with its blocks


def test_materialize_generate_chat_in_each_layout(twins2, repo, other_model_dir):
    """materialize, generate (after a named prefix, after files, with and without the
    cache), chat and route, with the model of the root layout and with the model of the
    second layout: the whole --json alike (before, only one layout and a few fields)."""
    for model, extra in ((twins2.model_dir, ()), (other_model_dir, ("--block-size", "32"))):
        m = ("--model", model, *extra)
        mv = run_json("model-version", model, *extra)  # needs no store
        bs = mv["layout"]["block_size"]
        made = twins2.same("materialize", repo, *m, "--name", f"repo-{bs}", "--no-progress")
        name = made["name"]
        assert made["model_version"] == mv["model_version"] and made["mode"] == "new"
        assert made["stored_blocks"] == made["tokens"] // bs > 0
        again = twins2.same("materialize", repo, *m, "--name", name, "--no-progress")
        assert again["mode"] == "unchanged" and again["computed_tokens"] == 0
        ask = ("generate", *m, "--prompt", "store the block", "--max-new-tokens", "4", "--no-progress")
        warm = twins2.same(*ask, "--prefix", name)
        assert warm["cached_tokens"] == made["stored_blocks"] * bs
        cold = twins2.same(*ask, "--prefix", name, "--no-cache")
        assert cold["cached_tokens"] == 0 and cold["tokens"] == warm["tokens"]
        files = twins2.same(*ask, "--prefix-from", repo)
        assert files["tokens"] == warm["tokens"] and files["cached_tokens"] == warm["cached_tokens"]
        assert twins2.same(*ask)["model_version"] == mv["model_version"]
        turns = same_lines(twins2, "chat", *m, "--prefix", name, "--max-new-tokens", "3", input="hello there\nagain\n")
        assert [t["turn"] for t in turns] == [1, 2] and turns[1]["cached_tokens"] > turns[0]["cached_tokens"] > 0
        twins2.restart_daemon()  # generate and chat leased the pages into the daemon's device tier
        r = run_json("route", "--node", twins2.home, "--node", twins2.socket, "--prefix", name, "--model", model,
                     *extra)
        assert list(r["per_node"].values()) == [warm["cached_tokens"]] * 2 and not r["errors"]
        h, s = r["tiers"].values()
        assert h == s and sum(h.values()) == made["stored_blocks"]
    listing = twins2.same("ls")
    assert [p["name"] for p in listing["prefixes"]] == ["docs", "other-docs", "repo-16", "repo-32"]
    layouts = twins2.same("layouts", ignore=LIMITS)["layouts"]
    assert {r["layout_id"]: r["prefixes"] for r in layouts} == {
        layout_id(twins2.layout): ["docs", "repo-16"], layout_id(OTHER): ["other-docs", "repo-32"]}
    # A prefix made in one layout, asked for by the model of the other: the same error.
    assert "another page layout" in same_error(twins2, "generate", "--model", other_model_dir, "--block-size", "32",
                                               "--prompt", "x", "--prefix", "repo-16")
    # A layout neither side holds: the same error but for the target it names; nothing made.
    ask = ("generate", "--model", other_model_dir, "--block-size", "64", "--prompt", "x", "--json")
    h = run(*ask, "--home", twins2.home, ok=False)
    s = run(*ask, "--socket", twins2.socket, ok=False)
    assert h.exit_code == s.exit_code == 1 and "holds no store of page layout" in h.output
    assert h.output.replace(str(twins2.home), "T") == s.output.replace(f"the daemon at {twins2.socket}", "T")
    assert len(twins2.same("layouts", ignore=LIMITS)["layouts"]) == 2


def test_refresh_export_import_of_the_second_models_prefix(twins2, repo, other_model_dir, tmp_path):
    """The model of the second layout: a pinned prefix, refreshed after an edit (only the
    changed file computed), exported, removed by ``invalidate --model``, and imported back
    checked against the model (``--model``, ``--verify-model``): alike on both sides."""
    m = ("--model", other_model_dir, "--block-size", "32", "--no-progress")
    assert twins2.same("materialize", repo, *m, "--name", "r", "--pin")["pinned"]
    twins2.restart_daemon()  # the daemon keeps a put's pages in its device tier too
    assert [p["pinned"] for p in twins2.same("ls")["prefixes"] if p["name"] == "r"] == [True]
    (repo / "src" / "f1.py").write_text("def index write read fsync commit evict pin\n")
    refreshed = twins2.same("materialize", repo, *m, "--name", "r")
    assert refreshed["mode"] == "append" and refreshed["changed"] == ["repo/src/f1.py"] and refreshed["pinned"]
    assert 0 < refreshed["computed_tokens"] < refreshed["tokens"]
    assert twins2.same("materialize", "--refresh", "r", *m)["mode"] == "unchanged"
    bundles = {side: tmp_path / f"{side}.tkv" for side in ("home", "socket")}
    a = run_json("export", "r", "-o", bundles["home"], "--home", twins2.home)
    b = run_json("export", "r", "-o", bundles["socket"], "--socket", twins2.socket)
    assert drop(a) == drop(b) and a["blocks"] == refreshed["tokens"] // 32 > 0
    twins2.restart_daemon()  # export leased the pages into the daemon's device tier
    gone = twins2.same("invalidate", "--model", other_model_dir)
    assert gone["removed_blocks"] >= a["blocks"] and a["model_version"] in gone["model_versions"]
    # Each side imports the other's bundle: refused under another model, alike.
    assert "bundle was made under model version" in same_error(twins2, "import", bundles["home"], "--model",
                                                               twins2.model_dir)
    ih = run_json("import", bundles["socket"], "--model", other_model_dir, "--verify-model", other_model_dir,
                  "--home", twins2.home)
    isock = run_json("import", bundles["home"], "--model", other_model_dir, "--verify-model", other_model_dir,
                     "--socket", twins2.socket)
    assert drop(ih) == drop(isock) and ih["stored_blocks"] == a["blocks"] and ih["durable"]
    twins2.restart_daemon()
    [r] = [p for p in twins2.same("ls")["prefixes"] if p["name"] == "r"]
    assert r["complete"] and r["resident"]["disk"] == a["blocks"]


def test_layouts_ls_and_rm(twins2):
    rows = twins2.same("layouts", ignore=LIMITS)["layouts"]
    assert twins2.same("layouts", "ls", ignore=LIMITS)["layouts"] == rows
    other = next(r for r in rows if r["layout_id"] == layout_id(OTHER))
    assert other["blocks"] == 7 and other["model_versions"] == sorted([MV_O, MV_B])
    assert other["used_bytes"]["disk"] > 0 and other["used_bytes"]["device"] == 0  # nothing in memory either side
    # Refused alike: it holds blocks and a prefix; an unknown id.
    assert "pass --yes" in same_error(twins2, "layouts", "rm", layout_id(OTHER))
    assert "no layout nope" in same_error(twins2, "layouts", "rm", "nope")
    removed = twins2.same("layouts", "rm", layout_id(OTHER), "--yes")
    assert removed["layout_id"] == layout_id(OTHER) and removed["removed_blocks"] == 7 and removed["freed_bytes"] > 0
    assert [r["layout_id"] for r in twins2.same("layouts", ignore=LIMITS)["layouts"]] == [layout_id(twins2.layout)]
    assert [p["name"] for p in twins2.same("ls")["prefixes"]] == ["docs"]
    s = twins2.same("stats", ignore=STATS_PER_PROCESS)
    assert s["blocks"] == 13 and s["model_versions"] == {twins2.mv: 9, MV_B: 4}
    # The last layout, the one the daemon was started with (before, the daemon refused: the
    # asking connection, which declared no layout, was bound to its only one and counted as
    # a user of it).
    assert twins2.same("layouts", "rm", layout_id(twins2.layout), "--yes")["removed_blocks"] == 13
    # A home whose every layout was removed lists nothing, as a daemon serving none does; a
    # directory that never held a store is still an error (a mistyped --home).
    assert twins2.same("layouts")["layouts"] == []
    assert twins2.same("ls")["prefixes"] == []
    assert twins2.same("stats", ignore=STATS_PER_PROCESS)["blocks"] == 0
    assert "holds no tierkv store" in run("layouts", "--home", twins2.home / "typo", ok=False).output


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
