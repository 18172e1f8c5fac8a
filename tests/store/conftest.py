"""Fixtures for the store tests: stores under tmp_path that are integrity-checked and closed
at the end of every test."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .kit import open_store

CHILD = Path(__file__).with_name("child.py")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def make_store(tmp_path: Path, home: Path):
    """make_store(home=None, **options) -> an open store; each one gets check_integrity()
    and close() when the test ends (stores a test closed itself are skipped)."""
    opened = []

    def make(at: Path | None = None, **options):
        s = open_store(at or home, shm_dir=tmp_path / "shm", **options)
        opened.append(s)
        return s

    yield make
    for s in opened:
        if not s.closed:
            try:
                s.check_integrity()
            finally:
                s.close()


@pytest.fixture
def child_cmd(tmp_path: Path):
    """Command line of the helper process (tests/store/child.py) for ``mode`` and args."""

    def cmd(mode: str, *args: object) -> list[str]:
        return [sys.executable, str(CHILD), mode, str(tmp_path / "shm"), *map(str, args)]

    return cmd
