"""Fixtures of the conformance suite: ``impl`` is each StoreAPI implementation in turn,
integrity-checked and closed after every test."""
from __future__ import annotations

import pytest

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
