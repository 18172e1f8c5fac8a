"""`tierkv chat` with piped input: one turn per line, each reusing the previous turns from the
store (prompt and answer), the tokens reused and the TTFT reported per turn."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tierkv.cli import main

pytestmark = pytest.mark.usefixtures("private_caches")


def chat(*args: object, lines: str) -> object:
    result = CliRunner().invoke(main, ["chat", *map(str, args)], input=lines)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result


def turns(*args: object, lines: str) -> list[dict]:
    return [json.loads(line) for line in chat(*args, "--json", lines=lines).stdout.splitlines()]


def test_chat_turns_reuse_prompt_and_answer(llama_dir, tmp_path):
    home = tmp_path / "home"
    lines = "store the block\n\nevict the page\n/exit\nnever asked\n"
    out = turns("--model", llama_dir, "--home", home, "--max-new-tokens", "24", lines=lines)
    assert [t["turn"] for t in out] == [1, 2]  # the empty line is skipped, /exit ends
    first, second = out
    assert first["cached_tokens"] == 0 and first["ttft_s"] > 0
    assert second["cached_tokens"] == (first["prompt_tokens"] + len(first["tokens"]) - 1) // 16 * 16
    assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["tokens"]) - 1
    # Without storing answers, the second turn hits only the first prompt's blocks.
    off = turns("--model", llama_dir, "--home", tmp_path / "home2", "--max-new-tokens", "24", "--no-store-output",
                lines=lines)
    assert [t["tokens"] for t in off] == [first["tokens"], second["tokens"]]
    assert off[1]["cached_tokens"] == first["prompt_tokens"] // 16 * 16
    human = chat("--model", llama_dir, "--home", home, "--max-new-tokens", "4", lines="store the block\n")
    assert human.stdout.startswith("assistant> ")
    assert "reused" in human.stderr and "TTFT" in human.stderr and "ms" in human.stderr


def test_chat_after_a_materialised_prefix(llama_dir, repo, tmp_path):
    home = tmp_path / "home"
    made = CliRunner().invoke(main, ["materialize", str(repo), "--model", str(llama_dir), "--home", str(home),
                                     "--name", "repo", "--no-progress", "--json"])
    assert made.exit_code == 0, made.output
    prefix_tokens = json.loads(made.stdout)["tokens"]
    out = turns("--model", llama_dir, "--home", home, "--prefix", "repo", "--max-new-tokens", "4",
                lines="store the block\nevict the page\n")
    assert out[0]["cached_tokens"] == prefix_tokens // 16 * 16 > 0
    assert out[0]["prompt_tokens"] > prefix_tokens and out[1]["cached_tokens"] >= out[0]["cached_tokens"]
    missing = CliRunner().invoke(main, ["chat", "--model", str(llama_dir), "--home", str(home), "--prefix", "nope"],
                                 input="x\n")
    assert missing.exit_code == 1 and "nope" in missing.stderr


def test_generate_stores_its_output_unless_told_not_to(llama_dir, tmp_path):
    ask = ["generate", "--model", str(llama_dir), "--prompt", "store the block", "--max-new-tokens", "20", "--json"]
    on = CliRunner().invoke(main, [*ask, "--home", str(tmp_path / "a")])
    off = CliRunner().invoke(main, [*ask, "--home", str(tmp_path / "b"), "--no-store-output"])
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    on_out, off_out = json.loads(on.stdout), json.loads(off.stdout)
    assert on_out["tokens"] == off_out["tokens"] and on_out["prompt_tokens"] < 16
    assert on_out["stored_output_blocks"] == (on_out["prompt_tokens"] + 19) // 16 >= 1
    assert off_out["stored_output_blocks"] == 0


def test_chat_through_a_daemon(llama_dir, tmp_path):
    import shutil
    import tempfile
    from pathlib import Path

    from helpers.daemons import DaemonThread
    from tierkv.daemon.config import DaemonConfig
    from tierkv.hf import version_of

    layout, _ = version_of(llama_dir)
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvchat-"))  # AF_UNIX paths are short
    cfg = DaemonConfig(home=d / "home", socket=d / "d.sock", layout=layout, device="cpu",
                       device_bytes=64 << 20, host_bytes=16 << 20, disk_bytes=256 << 20, shm_dir=d / "shm", workers=2)
    try:
        with DaemonThread(cfg):
            lines = "store the block\nevict the page\n"
            via = turns("--model", llama_dir, "--socket", cfg.socket, "--max-new-tokens", "24", lines=lines)
            local = turns("--model", llama_dir, "--home", tmp_path / "home", "--max-new-tokens", "24", lines=lines)
            assert [t["tokens"] for t in via] == [t["tokens"] for t in local]
            assert via[1]["cached_tokens"] == local[1]["cached_tokens"] == \
                (via[0]["prompt_tokens"] + len(via[0]["tokens"]) - 1) // 16 * 16
    finally:
        shutil.rmtree(d, ignore_errors=True)
