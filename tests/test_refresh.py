"""Refreshing a named prefix after an edit (issue #35): only the changed files are computed,
the result is what a full prefill of the new document gives, and old blocks are let go."""
from __future__ import annotations

import pytest
import torch

from tierkv import Priority
from tierkv.document import DocumentOptions
from tierkv.errors import ConfigError
from tierkv.hf import cached_prefill
from tierkv.identity import block_keys
from tierkv.materialize import load_prefix, materialize
from tierkv.refresh import refresh_prefix

pytestmark = pytest.mark.usefixtures("private_caches")

BS = 16


def _edit(path, line="def added_later():\n    return 'store the block'\n"):
    path.write_text(path.read_text() + line)


def _tokens_of(lm, text):
    return len(lm.encode_prompt(text))


def _same_logits_as_recomputation(store, lm, tokens):
    """The last logits of tokens + a question, restored from the store against computed
    without it (the project's fp32 tolerance)."""
    question = lm.encode_prompt("\nwhere is the block stored?")
    warm = cached_prefill(lm.model, tokens + question, store=store, scope=lm.scope("default"), store_new=False)
    cold = cached_prefill(lm.model, tokens + question)
    assert warm.cached_tokens >= len(tokens) // BS * BS > 0
    assert torch.max(torch.abs(warm.logits - cold.logits)).item() <= 1e-5


def _first_file(manifest, repo):
    return repo.parent / manifest["sources"][0]["path"]


def test_an_append_refresh_computes_the_edited_file_only(llama_lm, repo, store_factory):
    store = store_factory(llama_lm.layout)
    made = materialize(store, llama_lm, [repo], name="r", pin=True)
    edited = _first_file(made.manifest, repo)  # the worst place for a prefix: its first file
    _edit(edited)
    done = refresh_prefix(store, llama_lm, "r")
    assert done.mode == "append" and done.changes.changed == (edited.relative_to(repo.parent).as_posix(),)
    assert not done.changes.added and not done.changes.removed
    file_tokens = _tokens_of(llama_lm, edited.read_text())
    assert done.result.cached_tokens == made.tokens // BS * BS  # every stored block of the old document kept
    assert 0 < done.result.computed_tokens <= file_tokens + 2 * BS  # header and the old last partial block
    loaded = load_prefix(store, llama_lm, "r")
    assert len(loaded.tokens) == done.result.tokens and loaded.manifest["appended"][0]["change"] == "updated"
    _same_logits_as_recomputation(store, llama_lm, loaded.tokens)
    again = refresh_prefix(store, llama_lm, "r")
    assert again.mode == "unchanged" and again.result.computed_tokens == 0
    # Every block of the refreshed prefix is pinned, the kept ones included.
    keys = block_keys(loaded.tokens, llama_lm.scope("default"), BS)
    assert {store.placement.table.get(k).priority for k in keys} == {Priority.PINNED}


def test_added_and_removed_files_are_appended_and_load_checks_the_files(llama_lm, repo, store_factory):
    store = store_factory(llama_lm.layout)
    made = materialize(store, llama_lm, [repo], name="r")
    gone = repo.parent / made.manifest["sources"][1]["path"]
    gone.unlink()
    (repo / "new.py").write_text("def fresh():\n    return 1\n")
    done = refresh_prefix(store, llama_lm, "r")
    assert done.mode == "append" and done.changes.added == ("repo/new.py",)
    assert done.changes.removed == (gone.relative_to(repo.parent).as_posix(),)
    loaded = load_prefix(store, llama_lm, "r")
    assert [e["change"] for e in loaded.manifest["appended"]] == ["added", "removed"]
    assert llama_lm.decode(loaded.tokens).rstrip().endswith(f"=== {done.changes.removed[0]} (removed) ===")
    _same_logits_as_recomputation(store, llama_lm, loaded.tokens)
    _edit(repo / "new.py")  # the prefix no longer matches the files: an error that says how to refresh
    with pytest.raises(ConfigError, match="--refresh r"):
        load_prefix(store, llama_lm, "r")


def test_reorder_moves_the_changed_file_last_and_releases_the_old_chain(llama_lm, repo, store_factory):
    store = store_factory(llama_lm.layout)
    made = materialize(store, llama_lm, [repo], name="r", pin=True)
    old_keys = block_keys(load_prefix(store, llama_lm, "r").tokens, llama_lm.scope("default"), BS)
    edited = _first_file(made.manifest, repo)
    _edit(edited)
    done = refresh_prefix(store, llama_lm, "r", mode="reorder")
    assert done.mode == "reorder" and done.result.cached_tokens < BS  # the first file changed: little to keep
    loaded = load_prefix(store, llama_lm, "r")
    paths = [s["path"] for s in loaded.manifest["sources"]]
    assert paths[-1] == edited.relative_to(repo.parent).as_posix()
    assert paths[:-1] == [s["path"] for s in made.manifest["sources"][1:]]  # the recorded order kept
    _same_logits_as_recomputation(store, llama_lm, loaded.tokens)
    new_keys = set(block_keys(loaded.tokens, llama_lm.scope("default"), BS))
    released = [k for k in old_keys if k not in new_keys]
    assert released and {store.placement.table.get(k).priority for k in released} == {Priority.NORMAL}
    # Now the edited file is last: editing it again recomputes about that file alone.
    _edit(edited, "x = 2\n")
    last = refresh_prefix(store, llama_lm, "r", mode="reorder")
    assert last.result.computed_tokens <= _tokens_of(llama_lm, edited.read_text()) + 2 * BS


def test_an_append_past_max_stale_compacts(llama_lm, repo, store_factory):
    store = store_factory(llama_lm.layout)
    made = materialize(store, llama_lm, [repo], name="r")
    edited = repo.parent / made.manifest["sources"][-1]["path"]
    _edit(edited)
    assert refresh_prefix(store, llama_lm, "r", max_stale=0.5).mode == "append"
    _edit(edited, "y = 3\n")
    compacted = refresh_prefix(store, llama_lm, "r", max_stale=0.0)
    assert compacted.mode == "compact"
    loaded = load_prefix(store, llama_lm, "r")
    assert loaded.manifest["appended"] == [] and loaded.manifest["stale_bytes"] == 0
    assert llama_lm.decode(loaded.tokens).count(f"=== {edited.relative_to(repo.parent).as_posix()}") == 1
    _same_logits_as_recomputation(store, llama_lm, loaded.tokens)


def test_an_append_whose_chain_was_evicted_compacts(llama_lm, repo, store_factory):
    store = store_factory(llama_lm.layout)
    made = materialize(store, llama_lm, [repo], name="r")
    _edit(repo.parent / made.manifest["sources"][0]["path"])
    assert store.invalidate(namespace="default").removed_blocks > 0  # the blocks go, the manifest stays
    done = refresh_prefix(store, llama_lm, "r")
    assert done.mode == "compact" and done.result.cached_tokens == 0
    _same_logits_as_recomputation(store, llama_lm, load_prefix(store, llama_lm, "r").tokens)


def test_a_recorded_order_is_kept_when_the_history_order_moves(llama_lm, repo, store_factory):
    """Load re-derives the document in the order its manifest recorded, not in whatever
    order the tree gives today (here: mtimes that changed without any content change)."""
    import os

    store = store_factory(llama_lm.layout)
    made = materialize(store, llama_lm, [repo], DocumentOptions(order="history"), name="r")
    first = repo.parent / made.manifest["sources"][0]["path"]
    os.utime(first, ns=(4_000_000_000 * 10**9, 4_000_000_000 * 10**9))  # now the newest file
    assert load_prefix(store, llama_lm, "r").manifest["sources"] == made.manifest["sources"]
    done = refresh_prefix(store, llama_lm, "r")
    assert done.mode == "unchanged" and done.result.computed_tokens == 0
