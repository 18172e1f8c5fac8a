"""tierkv.materialize: chunked, resumable prefill of a document, manifests, prefix reload."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers import tiny_models
from helpers.stores import open_store
from tierkv.document import DocumentOptions
from tierkv.errors import ConfigError, ModelVersionMismatchError, NotFoundError
from tierkv.hf import load_model
from tierkv.materialize import document_tokens, load_prefix, materialize, tokens_sha256

pytestmark = pytest.mark.usefixtures("private_caches")


def test_materialize_then_repeat_does_no_work(llama_lm, repo, store_factory):
    store = store_factory(llama_lm.layout)
    seen: list[tuple[int, int]] = []
    first = materialize(store, llama_lm, [repo], name="repo", chunk_tokens=64, progress=lambda d, t: seen.append((d, t)))
    bs = llama_lm.layout.block_size
    assert first.cached_tokens == 0 and first.tokens > 200
    assert first.computed_tokens == first.tokens // bs * bs
    assert first.stored_blocks == first.tokens // bs and first.files == 7 and first.skipped == 1
    assert seen[0] == (0, first.computed_tokens) and seen[-1][0] == first.computed_tokens and len(seen) > 3
    again = materialize(store, llama_lm, [repo], name="repo", chunk_tokens=64)
    assert (again.computed_tokens, again.stored_blocks, again.cached_tokens) == (0, 0, first.computed_tokens)
    m = store.get_manifest("repo")
    tokens = load_prefix(store, llama_lm, "repo").tokens
    assert len(tokens) == m["tokens"] == first.tokens and m["tokens_sha256"] == tokens_sha256(tokens)
    assert m["model_version"] == llama_lm.model_version and m["blocks"] == first.stored_blocks
    assert m["last_block_key"] == store.lookup(tokens, llama_lm.scope()).keys[-1].hex()
    expected = ["repo/.gitignore"] + [f"repo/{'src' if i % 2 else 'docs'}/f{i}.py" for i in range(6)]
    assert [s["path"] for s in m["sources"]] == sorted(expected)


def test_prefix_reload_errors(llama_lm, repo, store_factory, tmp_path):
    store = store_factory(llama_lm.layout)
    materialize(store, llama_lm, [repo], name="repo", pin=True)
    with pytest.raises(NotFoundError):
        load_prefix(store, llama_lm, "nope")
    other = load_model(tiny_models.save_model_dir(tmp_path / "other", "llama", seed=5))
    assert other.layout == llama_lm.layout
    with pytest.raises(ModelVersionMismatchError, match="made under model version"):
        load_prefix(store, other, "repo")
    (repo / "src" / "f1.py").write_text("changed\n")
    with pytest.raises(ConfigError, match="changed since"):
        load_prefix(store, llama_lm, "repo")


def test_context_limit_and_max_tokens(tmp_path, repo, store_factory):
    lm = load_model(tiny_models.save_model_dir(tmp_path / "short", "llama", context=128))
    with pytest.raises(ConfigError, match=r"document has \d+ tokens; the model's context is 128 tokens") as exc:
        document_tokens(lm, [repo])
    assert "--max-tokens 128" in str(exc.value)
    store = store_factory(lm.layout)
    made = materialize(store, lm, [repo], max_tokens=100, name="cut")
    assert made.tokens == 100 and made.document_tokens > 128 and made.stored_blocks == 6
    assert len(load_prefix(store, lm, "cut").tokens) == 100


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import tierkv
    from tierkv.hf import load_model
    from tierkv.materialize import materialize
    model_dir, home, repo, marker = sys.argv[1:]
    lm = load_model(model_dir)
    store = tierkv.open(home, lm.layout, device_bytes=64 << 20, host_bytes=64 << 20, disk_bytes=256 << 20)
    def progress(done, total):
        if done >= 96:  # three chunks stored: tell the parent, then wait to be killed
            Path(marker).write_text(str(done))
            time.sleep(120)
    materialize(store, lm, [repo], chunk_tokens=32, progress=progress)
""")


def test_materialize_resumes_after_sigkill(llama_dir, llama_lm, repo, tmp_path):
    home, marker = tmp_path / "home", tmp_path / "marker"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(llama_dir), str(home), str(repo), str(marker)],
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), child.stderr.read().decode() if child.poll() is not None else "child too slow"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    scope = llama_lm.scope()
    with open_store(home, llama_lm.layout) as store:
        resumed = materialize(store, llama_lm, [repo], chunk_tokens=32)
        assert 96 <= resumed.cached_tokens < resumed.tokens // 16 * 16
        assert resumed.computed_tokens == resumed.tokens // 16 * 16 - resumed.cached_tokens
        tokens = document_tokens(llama_lm, [repo]).tokens
        with store.acquire(tokens, scope) as lease:
            resumed_pages = lease.pages()
        store.check_integrity()
    with open_store(tmp_path / "clean", llama_lm.layout) as clean:
        materialize(clean, llama_lm, [repo], chunk_tokens=10_000)
        with clean.acquire(tokens, scope) as lease:
            clean_pages = lease.pages()
    assert resumed_pages.shape[0] == len(tokens) // 16
    torch.testing.assert_close(resumed_pages, clean_pages, atol=1e-5, rtol=0)


def test_document_options_change_the_tokens(llama_lm, repo):
    everything = document_tokens(llama_lm, [repo]).tokens
    only_src = document_tokens(llama_lm, [repo], DocumentOptions(include=("*/src/*",))).tokens
    assert len(only_src) < len(everything)


def test_pin_covers_blocks_stored_by_an_earlier_unpinned_run(llama_lm, repo, store_factory):
    from tierkv.core.store import Priority

    store = store_factory(llama_lm.layout)
    materialize(store, llama_lm, [repo], max_tokens=64)  # first 4 blocks, unpinned
    made = materialize(store, llama_lm, [repo], pin=True)
    assert made.cached_tokens == 64 and made.stored_blocks > 0
    keys = store.lookup(document_tokens(llama_lm, [repo]).tokens, llama_lm.scope()).keys
    assert {store.placement.table.get(k).priority for k in keys} == {Priority.PINNED}
