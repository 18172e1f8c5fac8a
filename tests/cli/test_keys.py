"""``tierkv keys`` and the trust rule of ``tierkv import`` (issue 11, item 7): an import is
refused unless a trusted key signed the bundle."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Scope, block_keys
from tierkv.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))
from as_user import NOBODY, need_root, run_as  # noqa: E402 - the helper lives with the daemon tests

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


# ---- the keyring's ownership and mode (issue #34, item 8) -----------------------------------
def _bundle_signed_by_a_stranger(work: Path) -> tuple[Path, str]:
    """A bundle of a prefix, signed by a key nobody trusts; and that key's public half."""
    home, stranger = work / "made", work / "stranger-keys"
    tokens = np.random.default_rng(1).integers(0, 30_000, 24).astype("<i4")
    with tierkv.open(home, LAYOUT, **SMALL) as s:
        s.put(tokens, torch.randn(6, *LAYOUT.shape), Scope(MV))
        last = block_keys(tokens, Scope(MV), LAYOUT.block_size)[-1].hex()
        s.save_manifest("forged", {"last_block_key": last, "pinned": False})
    pub = run_json("keys", "generate", "--keys", stranger)["public_key"]
    bundle = work / "forged.tkv"
    run_json("export", "forged", "-o", bundle, "--home", home, "--keys", stranger)
    return bundle, pub


@pytest.fixture
def shared_dir():
    """A directory under /tmp another uid can pass through (pytest's tmp_path is 0700 root's)."""
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkv-keys-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_key_planted_by_another_user_in_a_world_writable_keyring_is_refused(shared_dir):
    """With root's keyring directory world-writable, uid 65534 swapped in its own trusted/
    holding its key, and root's `tierkv import` accepted the forged bundle it signed."""
    need_root()
    bundle, evil_pub = _bundle_signed_by_a_stranger(shared_dir)
    keys = shared_dir / "root-keys"
    run_json("keys", "generate", "--keys", keys)
    os.chmod(keys, 0o777)

    def plant() -> str:
        os.rename(keys / "trusted", keys / "was-trusted")
        (keys / "trusted").mkdir()
        (keys / "trusted" / "self.pub").write_text(evil_pub + "\n")
        return "planted"

    assert run_as(NOBODY, plant) == {"ok": "planted"}
    assert (keys / "trusted").stat().st_uid == NOBODY
    home = shared_dir / "victim"
    r = run("import", bundle, "--home", home, "--keys", keys, ok=False)
    assert r.exit_code == 1 and "refusing the keyring" in r.output, r.output
    assert f"owned by uid {NOBODY}" in r.output and "chown" in r.output and "mode 0777" in r.output
    assert not home.exists()  # refused before any home is made
    # Listing and trusting (a write) are refused the same way, not only import.
    for args in (("keys", "list"), ("keys", "trust", "x", evil_pub)):
        r = run(*args, "--keys", keys, ok=False)
        assert r.exit_code == 1 and "refusing the keyring" in r.output, r.output
    assert not (keys / "trusted" / "x.pub").exists()


@pytest.mark.parametrize("part, mode", [("", 0o775), ("trusted", 0o777), ("trusted/self.pub", 0o666),
                                        ("signing.key", 0o644)], ids=["dir", "trusted", "pub", "signing"])
def test_a_keyring_others_can_write_or_read_is_refused(tmp_path, part, mode):
    keys = tmp_path / "keys"
    run_json("keys", "generate", "--keys", keys)
    os.chmod(keys / part, mode)
    command = ("keys", "show") if part == "signing.key" else ("keys", "list")
    r = run(*command, "--keys", keys, ok=False)
    assert r.exit_code == 1 and f"mode {mode:04o}" in r.output and "chmod" in r.output, r.output
    os.chmod(keys / part, 0o600 if part == "signing.key" else 0o755 if part in ("", "trusted") else 0o644)
    run(*command, "--keys", keys)


def test_trusting_a_key_under_a_permissive_umask_still_writes_a_private_keyring(tmp_path):
    keys = tmp_path / "keys"
    old = os.umask(0)
    try:
        pub = run_json("keys", "generate", "--keys", keys)["public_key"]
        run("keys", "trust", "again", pub, "--keys", keys)
    finally:
        os.umask(old)
    assert (keys / "trusted" / "again.pub").stat().st_mode & 0o777 == 0o644
    assert run_json("keys", "list", "--keys", keys)["trusted"] == {"again": pub, "self": pub}
