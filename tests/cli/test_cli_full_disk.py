"""Issue #37, item 3: direct `generate --home` on a full disk answered with an error ("disk
tier write failed: ENOSPC"), or with a raw OSError when the disk was so full that the home's
LOCK record could not be written, where a daemon answers. Real file systems: a small tmpfs
(root only) holds the home; the answer must come, the same tokens as without the cache,
with a warning, and what was stored before keeps serving."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

import tierkv
from helpers.mounts import tmpfs
from tierkv.cli import main
from tierkv.home.directory import find_layouts

pytestmark = pytest.mark.usefixtures("private_caches")


@pytest.fixture(autouse=True)
def _root_only(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    monkeypatch.delenv("TIERKV_SOCKET", raising=False)


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def answer(*args) -> dict:
    return json.loads(run(*args, "--json").stdout.strip().splitlines()[-1])


def fill(path) -> None:
    """Write a file until the file system refuses (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\1" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_generate_on_a_disk_too_small_for_a_segment_answers(llama_dir, repo, tmp_path):
    ask = ("--model", llama_dir, "--prompt", "store the block", "--max-new-tokens", "4", "--no-progress",
           "--prefix-from", repo)
    cold = answer("generate", *ask, "--no-cache")
    with tmpfs(tmp_path / "fs", 1 << 20) as fs:  # a segment file of the default size does not fit
        r = run("generate", *ask, "--home", fs / "home", "--json")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["tokens"] == cold["tokens"]
        assert "No space left on device" in r.stderr and "the answer goes on" in r.stderr
        # A second request in a new process: the same (nothing half-written got in the way).
        assert answer("generate", *ask, "--home", fs / "home")["tokens"] == cold["tokens"]


def test_generate_on_a_full_disk_serves_what_was_stored(llama_dir, repo, tmp_path):
    ask = ("--model", llama_dir, "--prompt", "hello there " * 20, "--max-new-tokens", "8", "--no-progress")
    with tmpfs(tmp_path / "fs", 4 << 20) as fs:
        home = fs / "home"
        made = answer("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress")
        assert made["stored_blocks"] > 0
        fill(fs / "filler")  # nothing left: not a segment, an index page, nor the LOCK record
        cold = answer("generate", *ask, "--home", tmp_path / "unused", "--prefix-from", repo, "--no-cache")
        r = run("generate", *ask, "--home", home, "--prefix", "repo", "--json")
        warm = json.loads(r.stdout.strip().splitlines()[-1])
        assert warm["tokens"] == cold["tokens"] and warm["cached_tokens"] == made["stored_blocks"] * 16
        assert "No space left on device" in r.stderr and "the answer goes on" in r.stderr
        (fs / "filler").unlink()
        with tierkv.open(home, find_layouts(home)[0][1]) as st:
            st.check_integrity()
            assert st.stats().blocks == made["stored_blocks"]
