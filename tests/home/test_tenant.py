"""TenantView (issue #32): a home as one uid sees it under namespace_per_uid. Two tenants
of one home neither hit, read, pin, name nor count each other's blocks, and only the
daemon's uid runs what reads every tenant's blocks."""
from __future__ import annotations

import pytest
import torch

import tierkv
from tierkv import PageLayout, Priority, Scope
from tierkv.errors import NotFoundError, NotPermittedError
from tierkv.home import Home
from tierkv.home.tenancy import Tenancy
from tierkv.home.tenant import TenantView

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
SCOPE = Scope("ab" * 32, "chat")


def _put(view: TenantView, seed: int, n_blocks: int) -> list[int]:
    tokens = [seed * 100 + i for i in range(n_blocks * LAYOUT.block_size)]
    pages = torch.randn(n_blocks, *LAYOUT.shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.torch_dtype)
    assert view.put(tokens, pages, SCOPE).stored == n_blocks
    return tokens


@pytest.fixture
def home(tmp_path):
    store = tierkv.open(tmp_path / "home", LAYOUT, device="cpu", shm_dir=tmp_path / "shm", device_bytes=1 << 20,
                        host_bytes=0, disk_bytes=4 << 20)
    with Home(tmp_path / "home", [store]) as h:
        yield h


def test_two_tenants_of_one_home_are_apart(home):
    tenancy = Tenancy(per_uid=True, daemon_uid=0)
    a, b = TenantView(home, tenancy, 1001), TenantView(home, tenancy, 1002)
    tokens = _put(a, 1, 3)
    last = a.block_keys(tokens, SCOPE)[-1]
    assert a.lookup(tokens, SCOPE).num_blocks == 3 and b.lookup(tokens, SCOPE).num_blocks == 0
    assert last != b.block_keys(tokens, SCOPE)[-1]  # keyed under each tenant's own namespace
    assert a.chain_tokens(last).namespace == "chat"  # as the tenant names it
    with pytest.raises(NotFoundError):
        b.chain_tokens(last)
    assert b.set_priority_from(last, Priority.PINNED) == 0 and b.chain_residency(last).blocks == 0
    assert a.set_priority_from(last, Priority.PINNED) == 3

    a.save_manifest("p", {"namespace": "chat", "last_block_key": last.hex()})
    assert a.get_manifest("p")["namespace"] == "chat"
    assert home.get_manifest("uid1001:p")["namespace"] == "uid1001/chat"  # stored where its blocks are
    with pytest.raises(NotFoundError, match=r"known: none"):
        b.get_manifest("p")
    assert b.list_manifests() == {} and b.delete_manifest("p") is False and "p" in a.list_manifests()

    assert dict(a.stats().namespaces) == {"chat": 3} and dict(b.stats().namespaces) == {}
    assert dict(a.stats().model_versions) == {}  # which models others serve stays hidden
    _put(b, 2, 2)
    assert b.invalidate(model_version=SCOPE.model_version).removed_blocks == 2  # its own only
    assert a.lookup(tokens, SCOPE).num_blocks == 3

    with pytest.raises(NotPermittedError):
        a.verify()
    with pytest.raises(NotPermittedError):
        a.check_integrity()
    daemon = TenantView(home, tenancy, 0)
    assert daemon.verify().checked == 3


def test_a_closed_view_refuses_and_leaves_the_home_open(home):
    view = TenantView(home, Tenancy(per_uid=True, daemon_uid=0), 7)
    tokens = _put(view, 3, 1)
    view.close()
    with pytest.raises(NotFoundError, match="closed"):
        view.lookup(tokens, SCOPE)
    assert home.lookup(tokens, Scope(SCOPE.model_version, "uid7/chat")).num_blocks == 1
