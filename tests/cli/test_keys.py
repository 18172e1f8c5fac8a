"""``tierkv keys`` and the trust rule of ``tierkv import`` (issue 11, item 7): an import is
refused unless a trusted key signed the bundle."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Scope, block_keys
from tierkv.cli import main

LAYOUT = PageLayout(2, 2, 8, block_size=4)
MV = hashlib.sha256(b"keys model").hexdigest()
SMALL = {"device": "cpu", "device_bytes": 8 * LAYOUT.page_bytes, "host_bytes": 0, "disk_bytes": 64 << 20}


def run(*args, ok: bool = True):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert r.exit_code == 0, r.output
    return r


def run_json(*args) -> dict:
    return json.loads(run(*args, "--json").stdout.strip().splitlines()[-1])


def test_keys_sign_export_and_gate_import(tmp_path):
    alice, bob = tmp_path / "alice-keys", tmp_path / "bob-keys"
    home = tmp_path / "home"
    tokens = np.random.default_rng(0).integers(0, 30_000, 24).astype("<i4")
    with tierkv.open(home, LAYOUT, **SMALL) as s:
        s.put(tokens, torch.randn(6, *LAYOUT.shape), Scope(MV))
        last = block_keys(tokens, Scope(MV), LAYOUT.block_size)[-1].hex()
        s.save_manifest("docs", {"last_block_key": last, "pinned": False})
    pub = run_json("keys", "generate", "--keys", alice)["public_key"]
    assert run_json("keys", "show", "--keys", alice)["public_key"] == pub
    assert run_json("keys", "list", "--keys", alice)["trusted"] == {"self": pub}
    assert run("keys", "generate", "--keys", alice, ok=False).exit_code != 0  # no silent overwrite
    bundle = tmp_path / "docs.tkv"
    run_json("export", "docs", "-o", bundle, "--home", home, "--keys", alice)

    # Bob has not trusted Alice: refused, nothing stored (not even a home created).
    r = run("import", bundle, "--home", tmp_path / "bob", "--keys", bob, ok=False)
    assert r.exit_code == 1 and "cannot be trusted" in r.output and "keys trust" in r.output
    assert not (tmp_path / "bob").exists()
    key_file = tmp_path / "alice.pub"
    key_file.write_text(pub + "\n")
    run("keys", "trust", "alice", key_file, "--keys", bob)
    assert run_json("import", bundle, "--home", tmp_path / "bob", "--keys", bob)["stored_blocks"] == 6
    run("keys", "untrust", "alice", "--keys", bob)
    r = run("import", bundle, "--home", tmp_path / "bob2", "--keys", bob, ok=False)
    assert r.exit_code == 1 and "untrusted key" in r.output
    assert run("keys", "trust", "bad", "zz", "--keys", bob, ok=False).exit_code != 0


def test_what_keys_show_prints_is_what_keys_trust_takes(tmp_path):
    """Issue #37, item 7: `keys show`'s output (`public_key  HEX`) was refused by `keys trust`."""
    alice, bob = tmp_path / "alice-keys", tmp_path / "bob-keys"
    pub = run_json("keys", "generate", "--keys", alice)["public_key"]
    shown = run("keys", "show", "--keys", alice).stdout
    assert shown.strip() == pub
    as_file = tmp_path / "alice.pub"
    as_file.write_text(shown)
    json_file = tmp_path / "alice.json"
    json_file.write_text(run("keys", "show", "--keys", alice, "--json").stdout)
    older = tmp_path / "alice-older.pub"
    older.write_text(f"public_key  {pub}\n")  # what `keys show` printed before
    for name, key in (("file", as_file), ("text", shown), ("json", json_file), ("older", older),
                      ("json-text", json_file.read_text())):
        run("keys", "trust", name, key, "--keys", bob)
    assert run_json("keys", "list", "--keys", bob)["trusted"] == dict.fromkeys(
        ["file", "text", "json", "older", "json-text"], pub)
    r = run("keys", "trust", "bad", '{"public_key": "zz"}', "--keys", bob, ok=False)
    assert r.exit_code == 1 and "not an Ed25519 public key" in r.output
