"""The remote tier on its own: the object format, verification on every fetch, and the
fault handling (down, slow, setup failure, reconnect with backoff), against the fake store."""
from __future__ import annotations

import pytest
import torch

from tierkv.checksum import page_checksum
from tierkv.identity import block_keys
from tierkv.cluster.remote import BadObject, RemoteMeta, RemoteTier, decode_object, encode_object

from .kit import BS, LAYOUT, MV2, SCOPE, Clock, pages_for, remote_config, toks


def _metas(tokens, scope=SCOPE):
    keys = block_keys(tokens, scope, BS)
    pages = pages_for(tokens, scope)
    metas = [RemoteMeta(k, keys[i - 1] if i else scope.seed, scope.model_version, scope.namespace,
                        bytes(torch.tensor(tokens[i * BS:(i + 1) * BS], dtype=torch.int32).numpy().tobytes()),
                        page_checksum(k, pages[i])) for i, k in enumerate(keys)]
    return keys, pages, metas


def _tier(cluster, clock=None, **kw):
    return RemoteTier(remote_config(**kw), LAYOUT, backend_factory=cluster.factory, clock=clock or Clock())


def test_object_roundtrip_keeps_page_and_metadata():
    keys, pages, metas = _metas(toks(1, 2))
    blob = encode_object(metas[1], LAYOUT, pages[1])
    got = decode_object(blob, LAYOUT)
    assert got.meta == metas[1]
    assert torch.equal(got.page, pages[1])


@pytest.mark.parametrize("where", ["magic", "header", "page", "truncated", "layout"])
def test_damaged_object_is_rejected(where):
    _, pages, metas = _metas(toks(1, 1))
    blob = bytearray(encode_object(metas[0], LAYOUT, pages[0]))
    if where == "magic":
        blob[0] ^= 1
    elif where == "header":
        blob[100] ^= 1
    elif where == "page":
        blob[-5] ^= 0x40
    elif where == "truncated":
        del blob[-1]
    with pytest.raises(BadObject):
        other = LAYOUT if where != "layout" else type(LAYOUT)(2, 2, 8, block_size=4, dtype="float16")
        decode_object(bytes(blob), other)


def test_put_exists_get(cluster):
    tier = _tier(cluster)
    keys, pages, metas = _metas(toks(2, 3))
    r = tier.put_pages(keys, pages, metas)
    assert (r.published, r.skipped, r.failed) == (3, 0, 0)
    assert tier.put_pages(keys, pages, metas).skipped == 3
    assert tier.exists(keys + [b"\x00" * 32]) == [True, True, True, False]
    got = tier.get_pages(keys, metas)
    assert [torch.equal(g.page, p) for g, p in zip(got, pages, strict=True)] == [True] * 3
    assert all(name.startswith("tierkv/") for name in cluster.objects)
    tier.check_integrity()
    tier.close()


def test_corrupt_object_is_a_counted_miss_and_removed(cluster):
    tier = _tier(cluster)
    keys, pages, metas = _metas(toks(3, 2))
    tier.put_pages(keys, pages, metas)
    name = tier.name(keys[1])
    blob = bytearray(cluster.objects[name])
    blob[-100] ^= 0xFF
    cluster.objects[name] = bytes(blob)
    got = tier.get_pages(keys, metas)
    assert len(got) == 1  # the run stops at the bad page
    assert tier.faults["verify_failed"] == 1
    assert name not in cluster.objects
    assert tier.up  # a bad object is not a connection fault
    tier.close()


def test_page_stored_under_another_key_is_a_miss(cluster):
    tier = _tier(cluster)
    keys, pages, metas = _metas(toks(4, 2))
    tier.put_pages(keys, pages, metas)
    cluster.objects[tier.name(keys[0])] = cluster.objects[tier.name(keys[1])]
    assert tier.get(keys[0], metas[0]) is None
    assert tier.faults["verify_failed"] == 1


@pytest.mark.parametrize("field,value", [("model_version", MV2), ("namespace", "other"), ("tokens", b"\x00" * 16)])
def test_expectation_mismatch_is_a_miss(cluster, field, value):
    from dataclasses import replace

    tier = _tier(cluster)
    keys, pages, metas = _metas(toks(5, 1))
    tier.put_pages(keys, pages, metas)
    assert tier.get(keys[0], replace(metas[0], **{field: value})) is None
    assert tier.faults["verify_failed"] == 1


def test_master_down_degrades_then_reconnects_with_backoff(cluster):
    clock = Clock()
    tier = _tier(cluster, clock, backoff_initial_s=1.0, backoff_max_s=4.0)
    keys, pages, metas = _metas(toks(6, 2))
    tier.put_pages(keys, pages, metas)
    cluster.down = True
    assert tier.exists(keys) == [False, False]
    assert not tier.up and tier.faults["unreachable"] == 1
    calls = tier.faults.total()
    assert tier.exists(keys) == [False, False] and tier.get(keys[0]) is None
    assert tier.faults.total() == calls  # within the backoff: answered at once, no call made
    clock.t += 1.0
    assert tier.exists(keys) == [False, False]  # probe fails: backoff doubles
    assert tier.faults["unreachable"] == 2
    cluster.down = False
    clock.t += 1.0
    assert tier.exists(keys) == [False, False]  # still inside the doubled backoff
    clock.t += 1.0
    assert tier.exists(keys) == [True, True]
    assert tier.up and tier.counters["reconnects"] == 1
    tier.check_integrity()
    tier.close()


def test_slow_master_times_out_and_client_is_replaced(cluster):
    clock = Clock()
    tier = _tier(cluster, clock, op_timeout_s=0.5)
    keys, pages, metas = _metas(toks(7, 1))
    tier.put_pages(keys, pages, metas)
    cluster.hang_s = 1.5
    assert tier.exists(keys) == [False]
    assert tier.faults["timeout"] == 1 and not tier.up
    cluster.hang_s = 0.0
    clock.t += 10
    assert tier.exists(keys) == [True]
    assert cluster.setups == 2  # the hung client was dropped, a fresh one set up
    tier.close()


def test_setup_failure_is_counted_and_retried(cluster):
    clock = Clock()
    cluster.refuse_setup = True
    tier = _tier(cluster, clock)
    keys, pages, metas = _metas(toks(8, 1))
    assert tier.put_pages(keys, pages, metas).failed == 1
    assert tier.faults["setup_failed"] == 1
    cluster.refuse_setup = False
    clock.t += 10
    assert tier.put_pages(keys, pages, metas).published == 1
    tier.close()


def test_config_is_validated():
    with pytest.raises(ValueError):
        remote_config(key_prefix="has space")
    with pytest.raises(ValueError):
        remote_config(master_address="nohost")


def test_check_master_refuses_absent_and_stalled_masters():
    import http.server
    import socket
    import threading
    import time

    from tierkv.cluster.master import free_port
    from tierkv.cluster.remote import check_master

    with pytest.raises(OSError):  # nothing listening
        check_master(remote_config(master_address=f"127.0.0.1:{free_port()}"), timeout_s=1.0)
    stalled = socket.socket()  # accepts TCP (the kernel does) but never answers, like a SIGSTOPped master
    stalled.bind(("127.0.0.1", 0))
    stalled.listen()
    port = stalled.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(OSError):
        check_master(remote_config(master_address=f"127.0.0.1:{port}",
                                   metadata_url=f"http://127.0.0.1:{port}/metadata"), timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    stalled.close()

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_error(404)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        check_master(remote_config(master_address=f"127.0.0.1:{port}",
                                   metadata_url=f"http://127.0.0.1:{port}/metadata"), timeout_s=2.0)
    finally:
        server.shutdown()
        server.server_close()


def test_exists_is_batched(cluster):
    from tierkv.cluster import remote

    tier = _tier(cluster)
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(remote.EXISTS_BATCH + 5)]
    assert tier.exists(keys) == [False] * len(keys)
    assert tier.counters["exists_calls"] == 2
    tier.close()
