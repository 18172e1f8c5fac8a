"""Issue 10's "done when": one daemon started on an empty home with nothing but a home and a
socket; two different models (a Llama-shaped and a Qwen2-shaped tiny random model, other KV
shapes) materialise and generate warm through it, `tierkv stats --socket` shows both, and a
restarted daemon still serves both."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import tiny_models
from tierkv.cli import main
from tierkv.home.directory import layout_id
from tierkv.hf import version_of

from helpers.daemons import DaemonThread
from daemon_helpers import make_config

pytestmark = pytest.mark.usefixtures("private_caches")


def run_json(*args) -> dict:
    r = CliRunner().invoke(main, [str(a) for a in args] + ["--json"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_two_models_through_one_daemon_and_a_restart(llama_dir, repo, workdir, tmp_path_factory):
    qwen_dir = tiny_models.save_model_dir(tmp_path_factory.mktemp("models") / "qwen2", "qwen2", kv_heads=1, layers=3)
    layouts = {name: version_of(d)[0] for name, d in (("llama", llama_dir), ("qwen2", qwen_dir))}
    assert layouts["llama"] != layouts["qwen2"]
    cfg = make_config(workdir, layout=None, max_layouts=None, device_bytes=32 << 20, host_bytes=8 << 20,
                      disk_bytes=128 << 20, staging_bytes=4 << 20, client_staging_bytes=2 << 20)
    sock = ("--socket", cfg.socket)
    made = {}
    d = DaemonThread(cfg).start()
    try:
        for name, model in (("llama", llama_dir), ("qwen2", qwen_dir)):
            # The second model's layout is new to the daemon: asked for with --new-layout
            # (issue #37, item 2: without it a command for an unknown layout is an error).
            new = ("--new-layout",) if made else ()
            made[name] = run_json("materialize", repo, "--model", model, *sock, "--name", f"repo-{name}", "--no-progress",
                                  *new)
            assert made[name]["stored_blocks"] > 0
        s = run_json("stats", *sock)
        assert set(s["layouts"]) == {layout_id(lo) for lo in layouts.values()}
        for name, lo in layouts.items():
            assert s["layouts"][layout_id(lo)]["blocks"] == made[name]["stored_blocks"]
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
    d = DaemonThread(cfg).start()  # a restart finds both layouts in the home
    try:
        assert set(run_json("stats", *sock)["layouts"]) == {layout_id(lo) for lo in layouts.values()}
        for name, model in (("llama", llama_dir), ("qwen2", qwen_dir)):
            warm = run_json("generate", "--model", model, "--prompt", "store the block", "--max-new-tokens", "2",
                            *sock, "--prefix", f"repo-{name}")
            assert warm["cached_tokens"] == made[name]["tokens"] // 16 * 16 > 0
        names = set(run_json("ls", *sock)["layouts"])
        assert names == {layout_id(lo) for lo in layouts.values()}
    finally:
        d.stop()
