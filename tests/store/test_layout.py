"""Page layout: pack/unpack against transformers-style KV, and format errors."""
from __future__ import annotations

import pytest
import torch

from tierkv import PageLayout
from tierkv.errors import PageFormatError
from tierkv.layout import pack_pages, unpack_pages

from .kit import LAYOUT, SCOPE, pages_for, toks


def _layer_kv(layout: PageLayout, seq: int, batch: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seq)
    shape = (batch, layout.num_kv_heads, seq, layout.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layout.num_layers)]


@pytest.mark.parametrize("layout", [
    LAYOUT,
    PageLayout(num_layers=3, num_kv_heads=1, head_dim=4, block_size=2),
    PageLayout(num_layers=2, num_kv_heads=4, head_dim=16, block_size=8, dtype="bfloat16"),
    PageLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16"),
])
@pytest.mark.parametrize("start_block,n_blocks,extra", [(0, 3, 0), (1, 2, 3), (2, 1, 1)])
def test_pack_unpack_round_trip(layout, start_block, n_blocks, extra):
    bs = layout.block_size
    seq = (start_block + n_blocks) * bs + extra
    kv = _layer_kv(layout, seq, dtype=layout.torch_dtype)
    pages = pack_pages(kv, layout, start_block * bs, n_blocks)
    assert pages.shape == (n_blocks, *layout.shape) and pages.is_contiguous()
    assert pages.dtype == layout.torch_dtype
    # Element by element: page b, layer l, K/V, token t, head h, dim d.
    for b in range(n_blocks):
        for layer, (k, v) in enumerate(kv):
            for t in range(bs):
                pos = (start_block + b) * bs + t
                assert torch.equal(pages[b, layer, 0, t], k[0, :, pos])
                assert torch.equal(pages[b, layer, 1, t], v[0, :, pos])
    back = unpack_pages(pages, layout)
    lo, hi = start_block * bs, (start_block + n_blocks) * bs
    for (k, v), (k2, v2) in zip(kv, back):
        assert k2.shape == (1, layout.num_kv_heads, n_blocks * bs, layout.head_dim)
        assert torch.equal(k2, k[:, :, lo:hi]) and torch.equal(v2, v[:, :, lo:hi])


def test_pack_takes_the_batch_row_and_converts_dtype():
    kv = _layer_kv(LAYOUT, 8, batch=3)
    pages = pack_pages(kv, LAYOUT, 0, 2, batch_index=2)
    assert torch.equal(unpack_pages(pages, LAYOUT)[1][0][0], kv[1][0][2])
    bf = PageLayout(2, 2, 8, 4, dtype="bfloat16")
    assert pack_pages(kv, bf, 0, 2).dtype == torch.bfloat16


def test_pack_rejects_mismatched_kv():
    kv = _layer_kv(LAYOUT, 8)
    with pytest.raises(PageFormatError):
        pack_pages(kv[:1], LAYOUT, 0, 1)  # one layer short
    with pytest.raises(PageFormatError):
        pack_pages(kv, LAYOUT, 4, 2)  # past the end of the sequence
    wrong_heads = PageLayout(2, 4, 8, 4)
    with pytest.raises(PageFormatError):
        pack_pages(kv, wrong_heads, 0, 1)
    wrong_dim = PageLayout(2, 2, 16, 4)
    with pytest.raises(PageFormatError):
        pack_pages(kv, wrong_dim, 0, 1)


@pytest.mark.parametrize("bad", [
    torch.zeros((1, *LAYOUT.shape), dtype=torch.float16),
    torch.zeros((1, *LAYOUT.shape), dtype=torch.int32),
    torch.zeros(LAYOUT.shape),  # 5-D: one page without the block dimension
    torch.zeros((1, 2, 2, 8, 2, 8)),  # block size 8 in a block-size-4 store
    torch.zeros((1, 3, 2, 4, 2, 8)),  # one layer too many
    torch.zeros((1, 2, 2, 4, 8, 2)),  # heads and head_dim swapped
])
def test_bad_pages_raise(bad):
    with pytest.raises(PageFormatError):
        LAYOUT.check_pages(bad)
    with pytest.raises(PageFormatError):
        unpack_pages(bad, LAYOUT)


def test_check_pages_rejects_non_tensors_and_counts():
    with pytest.raises(PageFormatError):
        LAYOUT.check_pages([[0.0]])
    with pytest.raises(PageFormatError):
        LAYOUT.check_pages(torch.zeros((2, *LAYOUT.shape)), n_blocks=3)


def test_store_put_rejects_bad_pages(make_store):
    store = make_store()
    tokens = toks(3, 2, extra=2)
    good = pages_for(tokens)
    with pytest.raises(PageFormatError):
        store.put(tokens, good.to(torch.float16), SCOPE)
    with pytest.raises(PageFormatError):
        store.put(tokens, good[0], SCOPE)
    with pytest.raises(PageFormatError):
        store.put(tokens, torch.cat([good, good[:1]]), SCOPE)  # 3 pages for 2 full blocks
    with pytest.raises(PageFormatError):
        store.put(tokens, good, SCOPE, start_block=1)
    with pytest.raises(PageFormatError):
        store.put(tokens, good[:1], SCOPE, start_block=-1)
    with pytest.raises(PageFormatError):
        store.put(tokens, "pages", SCOPE)
    assert store.lookup(tokens, SCOPE).tokens_matched == 0
    assert store.put(tokens, good[:1], SCOPE, start_block=1).stored == 1  # a suffix alone is fine


def test_layout_validation():
    for bad in (dict(num_layers=0), dict(head_dim=-1), dict(block_size=True), dict(dtype="int8"),
                dict(num_kv_heads=2.0)):
        args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, **{})
        args.update(bad)
        with pytest.raises(ValueError):
            PageLayout(**args)
    assert PageLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    assert LAYOUT.slot_bytes % 4096 == 0 and LAYOUT.slot_bytes >= LAYOUT.page_bytes
