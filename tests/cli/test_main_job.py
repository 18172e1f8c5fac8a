"""The main-job commands end to end through click: materialize, generate, model-version,
quickstart, and how bad input is reported (a message and exit status 1, no traceback)."""
from __future__ import annotations

import functools
import json
import re

import pytest
from click.testing import CliRunner

from helpers import tiny_models
from tierkv.cli import main
from tierkv.hf import version_of

pytestmark = pytest.mark.usefixtures("private_caches")


def run(*args: str, ok: bool = True) -> object:
    result = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output + repr(result.exception)
    else:
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
        assert result.stderr.splitlines()[-1].startswith("Error: ")
    return result


def run_json(*args: str) -> dict:
    lines = run(*args, "--json").stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_materialize_then_generate_with_and_without_cache(llama_dir, repo, tmp_path):
    home = tmp_path / "home"
    made = run_json("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress",
                    "--chunk-tokens", "64")
    assert made["stored_blocks"] == made["tokens"] // 16 > 0 and made["computed_tokens"] > 0
    again = run_json("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress")
    assert again["computed_tokens"] == 0 and again["stored_blocks"] == 0
    ask = ("--model", llama_dir, "--prompt", "store the block", "--max-new-tokens", "5")
    warm = run_json("generate", *ask, "--home", home, "--prefix", "repo")
    assert {"text", "tokens", "prompt_tokens", "cached_tokens", "ttft_s", "total_s"} <= set(warm)
    assert warm["cached_tokens"] == made["tokens"] // 16 * 16 and warm["prompt_tokens"] > made["tokens"]
    cold_home = tmp_path / "never-created"
    cold = run_json("generate", *ask, "--home", cold_home, "--prefix-from", repo, "--no-cache")
    assert cold["cached_tokens"] == 0 and cold["tokens"] == warm["tokens"]
    assert cold["prompt_tokens"] == warm["prompt_tokens"]
    assert not cold_home.exists()  # --no-cache never opened the store
    via_paths = run_json("generate", *ask, "--home", home, "--prefix-from", repo)
    assert via_paths["cached_tokens"] >= warm["cached_tokens"] and via_paths["tokens"] == warm["tokens"]
    human = run("generate", *ask, "--home", home, "--prefix", "repo").stdout
    assert "cached tokens" in human and "TTFT s" in human


def test_model_version_command(llama_dir):
    layout, version = version_of(llama_dir)
    assert run("model-version", llama_dir).stdout.strip() == version
    out = run_json("model-version", llama_dir, "--block-size", "32")
    assert out["model_version"] != version and out["layout"]["block_size"] == 32


def test_bad_input_is_reported_without_traceback(llama_dir, repo, tmp_path):
    home = tmp_path / "home"
    assert "does not exist" in run("model-version", tmp_path / "nope", ok=False).stderr
    (tmp_path / "not-a-model").mkdir()
    assert "no config.json" in run("generate", "--model", tmp_path / "not-a-model", "--prompt", "x",
                                   "--no-cache", ok=False).stderr
    mismatched = tiny_models.save_model_dir(tmp_path / "small-vocab", "llama", vocab_size=50)
    assert "outside the model's embedding of 50 rows" in run("generate", "--model", mismatched, "--prompt", "store the block", "--no-cache", ok=False).stderr
    (tmp_path / "empty-repo").mkdir()
    assert "no text files" in run("materialize", tmp_path / "empty-repo", "--model", llama_dir, "--home", home,
                                  ok=False).stderr
    # Issue #37, item 10: a missing path is an error before anything is written.
    assert "does not exist" in run("materialize", tmp_path / "typo", "--model", llama_dir, "--home", home,
                                   ok=False).stderr
    assert not home.exists()
    run("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress")
    assert "repo2" in run("generate", "--model", llama_dir, "--home", home, "--prefix", "repo2", "--prompt", "x",
                          ok=False).stderr
    # Same layout, other weights: the prefix belongs to another model version.
    other = tiny_models.save_model_dir(tmp_path / "other", "llama", seed=9)
    assert "model version" in run("generate", "--model", other, "--home", home, "--prefix", "repo", "--prompt", "x",
                                  ok=False).stderr
    # --prefix NAME --no-cache: the prefix's tokens from the store's manifest, none of its KV.
    cold = run_json("generate", "--model", llama_dir, "--home", home, "--prefix", "repo", "--no-cache", "--prompt",
                    "x", "--max-new-tokens", "1")
    assert cold["cached_tokens"] == 0
    # Nothing above damaged the store: the prefix still serves from cache.
    warm = run_json("generate", "--model", llama_dir, "--home", home, "--prefix", "repo", "--prompt", "x",
                    "--max-new-tokens", "1")
    assert warm["cached_tokens"] > 0 and warm["tokens"] == cold["tokens"]
    assert warm["prompt_tokens"] == cold["prompt_tokens"]


def test_a_cuda_device_the_machine_lacks_is_one_line(llama_dir, repo, tmp_path):
    """Issue #37, item 6: `--device cuda` on a CPU-only torch printed a 50-line traceback."""
    import torch

    bad = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    home = tmp_path / "home"
    for args in (("generate", "--prompt", "x", "--no-cache"), ("materialize", repo, "--home", home),
                 ("chat", "--home", home)):
        r = run(*args, "--model", llama_dir, "--device", bad, ok=False)  # exit 1, one "Error:" line
        assert f"device '{bad}' is not available" in r.stderr and "hint: pass --device" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert not home.exists()


def test_generate_shows_the_prefill_progress_on_stderr(llama_dir, repo, tmp_path):
    """Issue #37, item 8: `generate --prefix-from DIR` computed for 33 s without a word."""
    ask = ("generate", "--model", llama_dir, "--prefix-from", repo, "--prompt", "store the block",
           "--max-new-tokens", "2", "--home", tmp_path / "home", "--json")
    r = run(*ask)
    out = json.loads(r.stdout)  # stdout: the one JSON object, untouched by the bar
    bars = r.stderr.replace("\r", "\n")
    assert "prefill" in bars and f"{out['prompt_tokens']}/{out['prompt_tokens']}" in bars, r.stderr
    assert re.search(rf"prefill:\s+0%.* 0(\.00)?/{out['prompt_tokens']}", bars), r.stderr  # shown as the work starts
    again = run(*ask, "--no-progress")
    assert again.stderr == "" and json.loads(again.stdout)["cached_tokens"] > 0


def test_materialize_again_without_pin_keeps_the_pin(llama_dir, repo, tmp_path):
    """Issue #37, item 5: a repeated `materialize --name X` without --pin unpinned X."""
    import tierkv
    from tierkv.home import store_home
    from tierkv.hf import load_model, version_of
    from tierkv.document import DocumentOptions
    from tierkv.materialize import document_tokens
    from tierkv.store import Priority

    home = tmp_path / "home"
    args = ("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress")
    assert run_json(*args, "--pin")["pinned"] is True
    listed = run_json("ls", "--home", home)["prefixes"][0]
    again = run_json(*args)
    assert again["pinned"] is True and again["computed_tokens"] == 0
    assert run_json("ls", "--home", home)["prefixes"][0] == listed  # nothing changed, created_at included
    layout, _ = version_of(llama_dir)
    lm = load_model(llama_dir, device="cpu")
    with tierkv.open(store_home(home, layout), layout, device="cpu", host_bytes=0) as store:
        keys = store.lookup(document_tokens(lm, [repo], DocumentOptions(order="history")).tokens, lm.scope()).keys  # the CLI's order
        assert keys and {store.placement.table.get(k).priority for k in keys} == {Priority.PINNED}
    # `unpin` is how to unpin; a run after it keeps the prefix unpinned.
    run("unpin", "repo", "--home", home)
    assert run_json(*args)["pinned"] is False
    assert run_json("ls", "--home", home)["prefixes"][0]["pinned"] is False


def test_quickstart_with_a_user_model(llama_dir, tmp_path):
    out = run_json("quickstart", "--model", llama_dir, "--home", tmp_path / "home", "--max-tokens", "200",
                   "--max-new-tokens", "3")
    assert out["identical"] is True and out["cached_tokens"] == 192 and out["prefix_tokens"] == 200
    assert out["ttft_cold_s"] > 0 and out["ttft_warm_s"] > 0


def test_quickstart_builds_its_model_once(tmp_path, monkeypatch):
    import tierkv.quickstart as qs

    tiny = qs.TinyModelSpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
                            vocab_size=300, context=512)
    monkeypatch.setattr(qs, "ensure_quickstart_model", functools.partial(qs.ensure_quickstart_model, spec=tiny))
    home = tmp_path / "home"
    first = run("quickstart", "--home", home, "--max-tokens", "128", "--max-new-tokens", "2")
    assert "building the quickstart model" in first.stderr
    assert re.search(r"identical tokens\s+yes", first.stdout) and "speedup" in first.stdout
    config = (home / "quickstart" / "model" / "config.json").read_text()
    second = run_json("quickstart", "--home", home, "--max-tokens", "128", "--max-new-tokens", "2")
    assert (home / "quickstart" / "model" / "config.json").read_text() == config
    assert second["cached_tokens"] == second["prefix_tokens"] == 128 and second["identical"] is True


def test_materialize_generate_invalidate_through_a_daemon(llama_dir, repo, tmp_path):
    """The user path of the daemon issue: start `tierkv serve`, materialise through it,
    generate warm through it, invalidate after a weight change, see it in `stats`."""
    import shutil
    import tempfile
    from pathlib import Path

    from helpers.daemons import DaemonThread
    from tierkv.daemon.config import DaemonConfig

    layout, version = version_of(llama_dir)
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvmj-"))  # AF_UNIX paths are short
    cfg = DaemonConfig(home=d / "home", socket=d / "d.sock", layout=layout, device="cpu",
                       device_bytes=64 << 20, host_bytes=16 << 20, disk_bytes=256 << 20, shm_dir=d / "shm", workers=2)
    daemon = DaemonThread(cfg)
    try:
        daemon.start()
        sock = ("--socket", cfg.socket)
        made = run_json("materialize", repo, "--model", llama_dir, *sock, "--name", "repo", "--no-progress")
        assert made["stored_blocks"] == made["tokens"] // 16 > 0
        ask = ("--model", llama_dir, "--prompt", "store the block", "--max-new-tokens", "3")
        warm = run_json("generate", *ask, *sock, "--prefix", "repo")
        cold = run_json("generate", *ask, "--prefix-from", repo, "--no-cache", "--home", tmp_path / "unused")
        assert warm["cached_tokens"] == made["tokens"] // 16 * 16 and warm["tokens"] == cold["tokens"]
        before = run_json("stats", *sock)["tiers"]["disk"]["blocks"]
        assert before >= made["stored_blocks"]
        removed = run_json("invalidate", "--model-version", version, *sock)
        assert removed["removed_blocks"] == before and removed["freed_bytes"] > 0
        assert run_json("stats", *sock)["tiers"]["disk"]["blocks"] == 0
        again = run_json("generate", *ask, *sock, "--prefix", "repo")
        assert again["cached_tokens"] == 0 and again["tokens"] == cold["tokens"]
    finally:
        daemon.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_an_imported_prefix_serves_without_its_source_tree(llama_dir, repo, tmp_path):
    """Issue #37, item 4: `generate --prefix NAME` of an imported bundle failed with
    "SOURCE_DIR does not exist" unless the source tree sat at the path it had where the
    prefix was made, although the bundle carries the token ids."""
    import shutil

    src = tmp_path / "elsewhere" / "src"
    shutil.copytree(repo, src)
    a, b = tmp_path / "a", tmp_path / "b"
    made = run_json("materialize", src, "--model", llama_dir, "--home", a, "--name", "repo", "--no-progress",
                    "--max-tokens", "160")
    tail = run_json("materialize", src, "--model", llama_dir, "--home", a, "--name", "tail", "--no-progress",
                    "--max-tokens", "170")
    assert made["tokens"] == 160 and tail["tokens"] == 170
    ask = ("--model", llama_dir, "--prompt", "store the block", "--max-new-tokens", "5", "--no-progress")
    cold = run_json("generate", *ask, "--prefix-from", src, "--max-tokens", "160", "--no-cache")
    for name in ("repo", "tail"):
        run("export", name, "-o", tmp_path / f"{name}.tkv", "--home", a)
        run("import", tmp_path / f"{name}.tkv", "--home", b)
    shutil.rmtree(tmp_path / "elsewhere")  # another machine: no source tree
    for home in (b, a):
        warm = run_json("generate", *ask, "--home", home, "--prefix", "repo")
        assert warm["cached_tokens"] == 160 and warm["tokens"] == cold["tokens"]
        assert run_json("generate", *ask, "--home", home, "--prefix", "repo", "--no-cache")["tokens"] == cold["tokens"]
    # A prefix whose last tokens fill no block: its manifest keeps them (format 2), so all
    # 170 ids come back; a manifest without them (made before) serves its whole blocks and
    # says so.
    whole = run("generate", *ask, "--home", b, "--prefix", "tail", "--json")
    assert "fill no block" not in whole.stderr
    served = json.loads(whole.stdout.strip().splitlines()[-1])
    assert served["cached_tokens"] == 160 and served["prompt_tokens"] == cold["prompt_tokens"] + 10
    import tierkv
    from tierkv.home import store_home

    layout, _ = version_of(llama_dir)
    with tierkv.open(store_home(b, layout), layout, device="cpu", host_bytes=0) as store:
        older = store.get_manifest("tail")
        del older["tail_tokens"]
        store.save_manifest("tail", older)
    r = run("generate", *ask, "--home", b, "--prefix", "tail", "--json")
    assert "its last 10 tokens fill no block" in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["cached_tokens"] == 160
    # Blocks gone and no sources: the error names the missing tree.
    run("invalidate", "--namespace", "default", "--home", b)
    assert "do not exist" in run("generate", *ask, "--home", b, "--prefix", "repo", ok=False).stderr
