"""Cache-aware routing: the library function over node handles, and ``tierkv route``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import tierkv
from tierkv import Priority, Scope
from tierkv.cli import main
from tierkv.cluster import route

from .kit import BS, LAYOUT, MV1, SCOPE, STORE_OPTIONS, pages_for, toks


class Broken:
    def lookup(self, *a, **k):
        raise ConnectionError("daemon gone")


class Slow:
    def lookup(self, *a, **k):
        import time

        time.sleep(1.0)
        raise AssertionError("should have been abandoned")


def test_route_picks_the_node_with_the_longest_prefix_remote_tier_included(nodes):
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    t = toks(1, 6, extra=3)
    pages = pages_for(t)
    a.store.put(t[: 2 * BS], pages[:2], SCOPE)
    b.put(t, pages, SCOPE, priority=Priority.PINNED)  # b holds it all, and publishes it
    res = route(t, {"a": a, "b": b, "c": c, "x": Broken()}, SCOPE)
    assert res.best_node in ("a", "b")  # a's local 2 blocks + 4 remote = 6 = b's
    assert res.per_node == {"a": 6 * BS, "b": 6 * BS, "c": 6 * BS, "x": 0}
    assert res.best_node == "a"  # ties go to the first listed
    assert "daemon gone" in res.to_dict()["errors"]["x"]
    assert res.to_dict()["tiers"]["a"] == {"device": 2, "remote": 4}


def test_route_without_remote_prefers_local_holder(nodes):
    a, b = nodes("a"), nodes("b")
    t = toks(2, 4)
    b.store.put(t, pages_for(t), SCOPE)
    res = route(t, {"a": a.store, "b": b.store}, SCOPE)
    assert res.best_node == "b" and res.per_node == {"a": 0, "b": 4 * BS}
    assert route(t, {"a": a.store}, Scope(MV1, "other")).per_node == {"a": 0}


def test_route_never_waits_past_its_deadline():
    res = route(toks(3, 1), {"slow": Slow(), "dead": Broken()}, SCOPE, timeout_s=0.2)
    assert res.best_node is None and res.per_node == {"slow": 0, "dead": 0}


def _home_with(path: Path, tokens, layout=LAYOUT, scope=SCOPE, pages=None) -> Path:
    with tierkv.open(path, layout, shm_dir=path.parent / "shm", **STORE_OPTIONS) as s:
        s.put(tokens, pages if pages is not None else pages_for(tokens, scope), scope)
    return path


def test_cli_route_tokens_file_over_store_homes(tmp_path):
    t = toks(4, 5)
    a = _home_with(tmp_path / "a", t[: 2 * BS])
    b = _home_with(tmp_path / "b", t)
    f = tmp_path / "req.json"
    f.write_text(json.dumps(t))
    r = CliRunner().invoke(main, ["route", "--node", str(a), "--node", str(b), "--node", str(tmp_path / "nope"),
                                  "--tokens-file", str(f), "--model-version", MV1, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["best_node"] == str(b)
    assert out["per_node"] == {str(a): 2 * BS, str(b): 5 * BS, str(tmp_path / "nope"): 0}
    assert str(tmp_path / "nope") in out["errors"]


def test_cli_route_needs_a_request(tmp_path):
    r = CliRunner().invoke(main, ["route", "--node", str(tmp_path)])
    assert r.exit_code == 2 and "--prefix" in r.output


def test_cli_route_prompt_with_model(tmp_path, llama_dir):
    from tierkv.cli.cluster import _tokenizer_model

    lm = _tokenizer_model(llama_dir, "auto", 4)
    text = "def main():\n    return 42\n" * 3
    tokens = lm.encode_document(text)
    n = len(tokens) // 4
    assert n >= 2
    import torch

    pages = torch.zeros((n, *lm.layout.shape), dtype=lm.layout.torch_dtype)
    a = _home_with(tmp_path / "a", tokens, lm.layout, lm.scope(), pages)
    r = CliRunner().invoke(main, ["route", "--node", str(a), "--prompt", text, "--model", str(llama_dir),
                                  "--block-size", "4", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["best_node"] == str(a) and out["per_node"][str(a)] == n * 4


@pytest.fixture
def daemon_socket():
    """A tierkv daemon serving from a thread of this process; its socket path."""
    import shutil
    import tempfile

    from helpers.daemons import DaemonThread  # tierkv's own: an import error is a failure, never a skip
    from tierkv.daemon.config import DaemonConfig

    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvr-"))  # AF_UNIX paths are short
    config = DaemonConfig(home=work / "home", socket=work / "run" / "d.sock", layout=LAYOUT, device="cpu",
                          device_bytes=16 * LAYOUT.page_bytes, host_bytes=8 * LAYOUT.slot_bytes,
                          disk_bytes=64 * LAYOUT.slot_bytes, staging_bytes=256 << 10,
                          client_staging_bytes=64 << 10, shm_dir=work / "shm", workers=2)
    with DaemonThread(config):  # one that does not start fails the test, never skips it
        yield config.socket
    shutil.rmtree(work, ignore_errors=True)


def test_route_over_a_daemon_socket(daemon_socket, tmp_path):
    from tierkv.cluster import open_node

    t = toks(9, 3)
    with tierkv.connect(daemon_socket) as client:
        client.put(t, pages_for(t), SCOPE)
    empty = _home_with(tmp_path / "empty", toks(10, 1))
    nodes = {"daemon": open_node(daemon_socket), "home": open_node(empty)}
    try:
        res = route(t, nodes, SCOPE)
    finally:
        for n in nodes.values():
            n.close()
    assert res.best_node == "daemon" and res.per_node == {"daemon": 3 * BS, "home": 0}


def test_cli_route_named_prefix_found_on_any_node(tmp_path, llama_dir, llama_lm, repo):
    from tierkv.materialize import materialize

    opts = dict(device="cpu", device_bytes=64 << 20, host_bytes=0, disk_bytes=256 << 20, shm_dir=tmp_path / "shm")
    with tierkv.open(tmp_path / "a", llama_lm.layout, **opts) as s:
        made = materialize(s, llama_lm, [repo], name="docs")
    tierkv.open(tmp_path / "b", llama_lm.layout, **opts).close()
    nodes = [str(tmp_path / "b"), str(tmp_path / "a")]
    r = CliRunner().invoke(main, ["route", "--node", nodes[0], "--node", nodes[1], "--prefix", "docs",
                                  "--prompt", "what does f1 do?", "--model", str(llama_dir), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    bs = llama_lm.layout.block_size
    assert out["best_node"] == nodes[1]
    assert out["per_node"] == {nodes[0]: 0, nodes[1]: made.tokens // bs * bs}
    assert out["tokens"] > made.tokens
