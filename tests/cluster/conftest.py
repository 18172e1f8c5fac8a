"""Fixtures: two nodes with separate homes sharing one fake remote store; every node is
integrity-checked and closed when the test ends."""
from __future__ import annotations

from pathlib import Path

import pytest

from .kit import Clock, FakeCluster, make_node


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def nodes(tmp_path: Path, cluster: FakeCluster, clock: Clock):
    """nodes(name, **kw) -> a ClusterNode with its own home under tmp_path."""
    opened = []

    def make(name: str, **kw):
        n = make_node(tmp_path / name, cluster, clock, **kw)
        opened.append(n)
        return n

    yield make
    for n in opened:
        if not n.store.closed:
            n.check_integrity()
            n.close()
