"""`tierkv materialize` after an edit (issue #35), through --home and through a daemon:
the same command (or --refresh NAME) computes only the changed file, and --watch refreshes
on its own, one line per refresh."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tierkv.cli import main
from tierkv.hf import version_of

pytestmark = pytest.mark.usefixtures("private_caches")


@pytest.fixture
def target(request, llama_dir, tmp_path):
    """("--home", home) or ("--socket", path) of a daemon in a thread."""
    if request.param == "home":
        yield ("--home", str(tmp_path / "home"))
        return
    from helpers.daemons import DaemonThread
    from tierkv.daemon.config import DaemonConfig

    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvrf-"))  # AF_UNIX paths are short
    cfg = DaemonConfig(home=d / "home", socket=d / "d.sock", layout=version_of(llama_dir)[0], device="cpu",
                       device_bytes=64 << 20, host_bytes=16 << 20, disk_bytes=256 << 20, shm_dir=d / "shm", workers=2)
    try:
        with DaemonThread(cfg):
            yield ("--socket", str(cfg.socket))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_json(*args) -> dict:
    result = CliRunner().invoke(main, [str(a) for a in args] + ["--json", "--no-progress"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["home", "socket"], indirect=True)
def test_the_same_command_after_an_edit_computes_the_edited_file(llama_dir, repo, target):
    made = run_json("materialize", repo, "--model", llama_dir, *target, "--name", "r", "--pin")
    assert made["mode"] == "new" and made["cached_tokens"] == 0 and made["computed_tokens"] > 0
    edited = repo / "docs" / "f0.py"
    edited.write_text(edited.read_text() + "def later():\n    return 'the block'\n")
    again = run_json("materialize", repo, "--model", llama_dir, *target, "--name", "r")
    assert again["mode"] == "append" and again["changed"] == ["repo/docs/f0.py"]
    assert again["added"] == [] and again["removed"] == []
    assert again["cached_tokens"] == made["tokens"] // 16 * 16
    assert 0 < again["computed_tokens"] < made["tokens"] // 3 and again["pinned"]
    same = run_json("materialize", "--refresh", "r", "--model", llama_dir, *target)
    assert same["mode"] == "unchanged" and same["computed_tokens"] == 0 and same["tokens"] == again["tokens"]
    asked = run_json("generate", "--model", llama_dir, *target, "--prefix", "r", "--prompt", "store the block",
                     "--max-new-tokens", "2")
    assert asked["cached_tokens"] == again["tokens"] // 16 * 16
    (repo / "src" / "f1.py").unlink()
    gone = run_json("materialize", "--refresh", "r", "--model", llama_dir, *target, "--refresh-mode", "reorder")
    assert gone["mode"] == "reorder" and gone["removed"] == ["repo/src/f1.py"]


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                return line
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no line from the watcher in {timeout} s: {proc.stderr.read()}")


@pytest.mark.parametrize("target", ["home", "socket"], indirect=True)
def test_watch_refreshes_on_each_change(llama_dir, repo, target):
    run_json("materialize", repo, "--model", llama_dir, *target, "--name", "r")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierkv", "materialize", "--refresh", "r", "--watch", "--debounce-ms", "200",
         "--model", str(llama_dir), *target, "--json", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = json.loads(_read_line(proc, 120))
        assert first["mode"] == "unchanged"
        deadline = time.monotonic() + 30
        while "watching" not in proc.stderr.readline():  # the watcher is set up
            assert time.monotonic() < deadline
        time.sleep(0.5)
        edited = repo / "src" / "f3.py"
        edited.write_text(edited.read_text() + "z = 1\n")
        line = json.loads(_read_line(proc, 60))
        assert line["name"] == "r" and line["mode"] == "append" and line["changed"] == ["repo/src/f3.py"]
        assert 0 < line["recomputed_tokens"] < line["kept_tokens"]
        (repo / "notes.log").write_text("ignored by .gitignore\n")  # no refresh line for an ignored file
        (repo / "docs" / "new.py").write_text("print('new')\n")
        line = json.loads(_read_line(proc, 60))
        assert line["added"] == ["repo/docs/new.py"] and line["changed"] == []
    finally:
        # SIGTERM, as a supervisor stops it (a SIGINT may be ignored: a background job's is).
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0 and "stopped watching" in proc.stderr.read()
