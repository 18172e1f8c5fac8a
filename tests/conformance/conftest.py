"""Fixtures of the conformance suite: ``impl`` is each StoreAPI implementation in turn,
integrity-checked and closed after every test; ``twins`` and ``twins2``, the CLI's stores
behind ``--home`` and ``--socket`` (cli_kit.py)."""
from __future__ import annotations

from typing import Iterator

import pytest

from .cli_kit import Twins, open_twins
from .kit import KINDS, Impl, open_impl, remove, short_dir


@pytest.fixture(params=KINDS)
def impl(request) -> Impl:
    workdir = short_dir(f"tkvconf-{request.param[:3]}-")
    opened = open_impl(request.param, workdir)
    try:
        yield opened
        opened.api.check_integrity()
    finally:
        opened.close()
        remove(workdir)


@pytest.fixture
def api(impl: Impl):
    return impl.api


# ---- the CLI's twins (tests/conformance/cli_kit.py) ----------------------------------------
@pytest.fixture
def twins(llama_dir, monkeypatch, tmp_path) -> Iterator[Twins]:
    """A home and a daemon holding the same blocks of the model's one layout."""
    monkeypatch.delenv("TIERKV_SOCKET", raising=False)
    monkeypatch.setenv("TIERKV_KEYS", str(tmp_path / "keys"))
    with open_twins(llama_dir, two_layouts=False) as t:
        yield t


@pytest.fixture
def twins2(llama_dir, monkeypatch, tmp_path) -> Iterator[Twins]:
    """A home holding the model's layout at its root and OTHER under layouts/<id>, and a
    daemon serving both on a home of its own."""
    monkeypatch.delenv("TIERKV_SOCKET", raising=False)
    monkeypatch.setenv("TIERKV_KEYS", str(tmp_path / "keys"))
    with open_twins(llama_dir, two_layouts=True) as t:
        yield t
