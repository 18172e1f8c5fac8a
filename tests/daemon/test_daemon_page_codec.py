"""A daemon with ``page_codec="int8"``: clients put and acquire as with an exact home (the
device pool they map holds decoded pages), the host pool is not shared (it holds the stored
form), and after a restart the pages come back decoded, within the codec's bound."""
from __future__ import annotations

import pytest
import torch

import tierkv
from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, SCOPE, make_config, pages_for, prompt
from tierkv.codec import PageCodec
from tierkv.daemon.config import merge
from tierkv.errors import ConfigError


def test_int8_home_through_the_daemon(workdir):
    codec = PageCodec("int8", LAYOUT)
    toks, pages = prompt(64, seed=5), pages_for(4, 5)
    d = DaemonThread(make_config(workdir, page_codec="int8")).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            assert c.host_pool is None  # stored-form pages are not the layout's: not mapped
            c.put(toks, pages, SCOPE)
            with c.acquire(toks, SCOPE) as lease:
                assert lease.tokens_matched == 64 and torch.equal(lease.pages(), pages)  # exact in the device tier
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
    d = DaemonThread(make_config(workdir)).start()  # no codec named: the home's
    try:
        with tierkv.connect(d.config.socket) as c:
            with c.acquire(toks, SCOPE) as lease:
                assert lease.tokens_matched == 64
                got = lease.pages()
        assert torch.equal(got, codec.to_layout(codec.to_stored(pages)))
        groups = (-1, LAYOUT.block_size, LAYOUT.num_kv_heads * LAYOUT.head_dim)  # a channel over the block
        err = (got - pages).abs().reshape(groups)
        assert bool((err <= pages.abs().reshape(groups).amax(1, keepdim=True) / 127).all())
    finally:
        d.stop()


def test_page_codec_setting_is_checked(workdir):
    assert merge({"page_codec": "int8"}, {}, {}).page_codec == "int8"
    assert merge({}, {"page_codec": "none"}, {}).page_codec == "none"
    with pytest.raises(ConfigError, match="page_codec"):
        merge({"page_codec": "int4"}, {}, {})
