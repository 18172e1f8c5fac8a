"""Shared fixtures. Tiny models live in tests/helpers/tiny_models.py."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def _drop_repo_root_from_sys_path() -> None:
    # `python -m pytest` puts the repository root on sys.path. There the top-level kernels/
    # directory (installed as tierkv.kernels) looks like the Hugging Face `kernels` package that
    # transformers probes for, and `import transformers` then fails inside kernels/base.py.
    # Drop the root when tierkv stays importable without it (editable install).
    root = str(Path(__file__).resolve().parent.parent)
    kept = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    saved, sys.path[:] = list(sys.path), kept
    if "tierkv" not in sys.modules and importlib.util.find_spec("tierkv") is None:
        sys.path[:] = saved


_drop_repo_root_from_sys_path()


def _one_thread_in_forked_children() -> None:
    # Several tests fork (a child as another uid, a child that crashes mid-write) and use torch
    # in the child. torch's CPU build parallelises with GNU OpenMP, whose thread pool does not
    # survive fork(): once the parent ran a parallel region, the child's first one waits forever
    # for threads that do not exist (seen in CI: a 300 s hang in the full suite, never alone).
    # One thread in the child never enters a parallel region.
    import torch

    os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))


_one_thread_in_forked_children()

import pytest

from helpers import tiny_models
from helpers.stores import open_store


@pytest.fixture(scope="session", autouse=True)
def private_keyring(tmp_path_factory):
    """Bundle signing keys (tierkv keys, export, import) away from the real ~/.config."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERKV_KEYS", str(tmp_path_factory.mktemp("keys")))
        yield


@pytest.fixture
def private_caches(tmp_path_factory, monkeypatch):
    """model_version's digest memo and the CLI's default home away from the real ~.
    The main-job test modules use it for every test (pytestmark)."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(base / "xdg-data"))
    monkeypatch.delenv("TIERKV_HOME", raising=False)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return tiny_models.save_model_dir(tmp_path_factory.mktemp("models") / "llama", "llama")


@pytest.fixture
def store_factory(tmp_path):
    """open_store(layout, home=None) -> store under tmp_path; closes what it opened."""
    opened = []

    def make(layout, home: Path | None = None, **options):
        s = open_store(home or tmp_path / "home", layout, **options)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.check_integrity()
        s.close()


@pytest.fixture(scope="session")
def llama_lm(llama_dir):
    from tierkv.hf import load_model

    return load_model(llama_dir)


@pytest.fixture
def repo(tmp_path) -> Path:
    """A small repository of text the tiny tokenizer knows (a few hundred tokens)."""
    root = tmp_path / "repo"
    lines = tiny_models.corpus(36, seed=3)
    for i in range(6):
        p = root / ("src" if i % 2 else "docs") / f"f{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(lines[i * 6 : (i + 1) * 6]))
    (root / ".gitignore").write_text("*.log\n")
    (root / "debug.log").write_text("ignored\n")
    return root
