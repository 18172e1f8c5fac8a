"""Block identity: pinned key vectors, process independence, isolation, typed encoding,
token validation, and the model-version fingerprint."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import tierkv
from tierkv import PageLayout, Scope
from tierkv.errors import InvalidTokensError, NotFoundError
from tierkv.identity import as_token_array, block_keys, enc_field, enc_str
from tierkv.model_version import model_version

from .kit import BS, LAYOUT, MV1, MV2, SCOPE, pages_for, put_chain, toks

ZERO_MV = "00" * 32

# Pinned once from the implementation; any change of the encoding must fail here (and
# needs a new domain string, since every stored block would silently become a miss).
SEED_DEFAULT = "e1c7b2d730d7b533d6384ccb92d3fde7834f829957427e5017f7273fc159ade6"
KEYS_0_8 = [
    "63691ec2d0bce096325bbfee8946c8260e5daf1da560e08baee7817403828c04",
    "a8c3d8c5b3e3960d7d1dcd7f46aea8d321657822efb13b433fb28251cb40280f",
]
SEED_TENANT = "d61152cf5b7d50cc3c958977da39d740c6e63711bfcb37a6c73f5e95ee7b00c6"
KEYS_TENANT = [
    "2e9cb2c5713a67c4708446e95a4e9d0a5995547129a2122615fa594e8dca7b53",
    "1ec6a0daee3a52207b6e3ae125ffe58b3a208b38601e9b2ade9ea68fb448dec2",
]
ENC_FIELD_LIST = "6628000000000000007302000000000000006e736c14000000000000007301000000000000006162010000000000000062"


def test_key_vectors_pinned():
    scope = Scope(ZERO_MV)
    assert scope.seed.hex() == SEED_DEFAULT
    assert [k.hex() for k in block_keys(list(range(8)), scope, 4)] == KEYS_0_8
    tenant = Scope("ab" * 32, namespace="tenant-a", extra_keys=("lora:x",))
    assert tenant.seed.hex() == SEED_TENANT
    keys = block_keys([7, 7, 7, 7, 2**31 - 1, 0, 1, 2], tenant, 4, [["img:1"], [b"\x00"]])
    assert [k.hex() for k in keys] == KEYS_TENANT
    assert enc_field("ns", ["a", b"b"]).hex() == ENC_FIELD_LIST


def test_key_matches_the_documented_encoding():
    """Recompute seed and key[0] from the module docstring, independently of the code."""

    def item(tag: bytes, payload: bytes) -> bytes:
        return tag + struct.pack("<Q", len(payload)) + payload

    def s(x: str) -> bytes:
        return item(b"s", x.encode())

    def fld(name: str, body: bytes) -> bytes:
        return item(b"f", s(name) + body)

    seed = hashlib.sha256(
        s("tierkv/seed/v1") + fld("model_version", item(b"b", bytes(32))) + fld("namespace", s("default"))
        + fld("extra_keys", item(b"l", b""))
    ).digest()
    assert seed.hex() == SEED_DEFAULT
    tokens = np.arange(4, dtype="<i4").tobytes()
    key0 = hashlib.sha256(
        s("tierkv/block/v1") + item(b"b", seed) + item(b"t", tokens) + fld("block_extra", item(b"l", b""))
    ).digest()
    assert key0.hex() == KEYS_0_8[0]


# Imports tierkv.identity without tierkv/__init__ (and so without torch): a fast child.
_KEYS_SCRIPT = """
import json, sys, types
pkg = types.ModuleType("tierkv"); pkg.__path__ = [sys.argv[1]]; sys.modules["tierkv"] = pkg
from tierkv.identity import Scope, block_keys
scope = Scope(sys.argv[2], namespace="tenant-a", extra_keys=("lora:x",))
keys = block_keys(list(range(1000, 1013)), scope, 4, [["img:1"]])
print(json.dumps([scope.seed.hex(), *[k.hex() for k in keys], hash("tierkv") % 1000]))
"""


def test_keys_equal_across_processes_and_hash_seeds():
    pkg_dir = str(Path(tierkv.__file__).parent)
    procs = [
        subprocess.Popen([sys.executable, "-c", _KEYS_SCRIPT, pkg_dir, MV1],
                         env={**os.environ, "PYTHONHASHSEED": hash_seed}, stdout=subprocess.PIPE, text=True)
        for hash_seed in ("0", "4242", "random")
    ]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({o[-1] for o in outs}) > 1, "the children really ran with different hash seeds"
    here = Scope(MV1, namespace="tenant-a", extra_keys=("lora:x",))
    expected = [here.seed.hex(), *[k.hex() for k in block_keys(list(range(1000, 1013)), here, BS, [["img:1"]])]]
    for o in outs:
        assert o[:-1] == expected


def test_scope_parts_isolate_keys():
    tokens = list(range(16))
    variants = [
        Scope(MV1), Scope(MV2), Scope(MV1, namespace="tenant-b"), Scope(MV1, extra_keys=("lora:1",)),
        Scope(MV1, extra_keys=("lora:2",)), Scope(MV1, extra_keys=("lora:1", "lora:2")),
    ]
    firsts = {block_keys(tokens, sc, BS)[0] for sc in variants}
    assert len(firsts) == len(variants)
    # Same scope, same keys; block extras separate otherwise equal blocks.
    assert block_keys(tokens, Scope(MV1), BS) == block_keys(tokens, Scope(MV1), BS)
    assert block_keys(tokens, SCOPE, BS, [["img:a"]]) != block_keys(tokens, SCOPE, BS, [["img:b"]])
    assert block_keys(tokens, SCOPE, BS, [["img:a"]])[1] != block_keys(tokens, SCOPE, BS)[1]  # chained


def test_typed_encoding_has_no_concatenation_collisions():
    assert Scope(MV1, extra_keys=("ab", "c")).seed != Scope(MV1, extra_keys=("a", "bc")).seed
    assert Scope(MV1, extra_keys=("abc",)).seed != Scope(MV1, extra_keys=("ab", "c")).seed
    # A namespace "X" is not an adapter "X" (vLLM #44701), in either arrangement.
    assert Scope(MV1, namespace="X").seed != Scope(MV1, namespace="default", extra_keys=("X",)).seed
    assert Scope(MV1, namespace="X", extra_keys=("Y",)).seed != Scope(MV1, namespace="Y", extra_keys=("X",)).seed
    assert enc_field("namespace", "X") != enc_field("extra_keys", ["X"])
    assert enc_field("a", "b") != enc_field("a", b"b")  # str and bytes are typed apart
    tokens = list(range(8))
    assert block_keys(tokens, SCOPE, BS, [["ab", "c"]]) != block_keys(tokens, SCOPE, BS, [["a", "bc"]])
    assert block_keys(tokens, SCOPE, BS, [["x"]]) != block_keys(tokens, SCOPE, BS, [[b"x"]])
    assert enc_str("a") + enc_str("bc") != enc_str("ab") + enc_str("c")


def test_extra_keys_bare_string_is_one_key():
    # Regression: Scope(extra_keys="ab") used to become ("a", "b").
    assert Scope(MV1, extra_keys="ab").extra_keys == ("ab",)
    assert Scope(MV1, extra_keys="ab").seed != Scope(MV1, extra_keys=("a", "b")).seed
    assert Scope(MV1, extra_keys="ab").seed == Scope(MV1, extra_keys=("ab",)).seed


def test_scope_validation():
    with pytest.raises(ValueError):
        Scope("abc")
    with pytest.raises(ValueError):
        Scope("zz" * 32)
    with pytest.raises(ValueError):
        Scope(MV1, namespace="")


@pytest.mark.parametrize("n_tokens,n_keys", [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (9, 2), (12, 3)])
def test_only_full_blocks_get_keys(n_tokens, n_keys):
    assert len(block_keys(list(range(n_tokens)), SCOPE, BS)) == n_keys


@pytest.mark.parametrize("bad", [
    [-1, 2, 3, 4], [0, 2**31, 1, 2], [1.0, 2.0, 3.0, 4.0], [[1, 2], [3, 4]], np.array([1.5] * 4),
    torch.tensor([1.0, 2.0, 3.0, 4.0]), [True, False, True, True], [2**70, 1, 2, 3], 5, "abcd",
    # Lists that begin with an int take the array("i") path and fail inside it:
    [1, 2, 3, -4], [1, 2, 3, 2**31], [1, 2, 3, 4.0], [1, 2, 3, "4"], [1, 2, [3], 4], [1, 2**70, 3, 4],
])
def test_bad_tokens_raise(bad):
    with pytest.raises(InvalidTokensError):
        as_token_array(bad)
    with pytest.raises(InvalidTokensError):
        block_keys(bad, SCOPE, BS)


def test_token_forms_agree():
    ids = [0, 5, 2**31 - 1, 17]
    ref = block_keys(ids, SCOPE, BS)
    for form in (np.array(ids, dtype=np.int64), np.array(ids, dtype=np.uint32), torch.tensor(ids), tuple(ids),
                 [np.int64(i) for i in ids]):
        assert block_keys(form, SCOPE, BS) == ref


def test_store_rejects_bad_tokens_and_counts_only_full_blocks(make_store):
    store = make_store()
    tokens = toks(1, 2, extra=1)  # 9 tokens: 2 full blocks
    assert put_chain(store, tokens).stored == 2
    assert store.lookup(tokens, SCOPE).tokens_matched == 8
    assert store.lookup(tokens[:8], SCOPE).tokens_matched == 8
    assert store.lookup(tokens[:7], SCOPE).tokens_matched == 4
    assert store.lookup(tokens[:3], SCOPE).tokens_matched == 0
    for bad in ([-1] * 8, [1.5] * 8, [[1] * 4] * 2):
        with pytest.raises(InvalidTokensError):
            store.lookup(bad, SCOPE)
        with pytest.raises(InvalidTokensError):
            store.acquire(bad, SCOPE)
        with pytest.raises(InvalidTokensError):
            store.put(bad, pages_for(tokens[:8]), SCOPE)


def test_store_isolates_namespaces_versions_and_adapters(make_store):
    store = make_store()
    tokens = toks(2, 3)
    put_chain(store, tokens)
    assert store.lookup(tokens, SCOPE).tokens_matched == 12
    for other in (Scope(MV2), Scope(MV1, namespace="tenant-b"), Scope(MV1, extra_keys=("lora:1",))):
        assert store.lookup(tokens, other).tokens_matched == 0
        with store.acquire(tokens, other) as lease:
            assert lease.num_blocks == 0
    assert store.lookup(tokens, Scope(MV1, namespace="default")).tokens_matched == 12


# ---- model version ----------------------------------------------------------------------

def _model_dir(root: Path, weights: bytes = b"w" * 1000) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "tokenizer.json").write_text('{"vocab": {}}')
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_model_version_tracks_weights(tmp_path):
    d = _model_dir(tmp_path / "m")
    v1 = model_version(d, LAYOUT)
    assert len(v1) == 64 and Scope(v1)
    assert model_version(d, LAYOUT) == v1
    (d / "model.safetensors").write_bytes(b"W" + b"w" * 999)
    os.utime(d / "model.safetensors", ns=(1, 1))
    v2 = model_version(d, LAYOUT)
    assert v2 != v1
    (d / "extra.bin").write_bytes(b"more")
    assert model_version(d, LAYOUT) != v2
    # The directory's location does not matter; its contents do.
    d2 = _model_dir(tmp_path / "copy", (d / "model.safetensors").read_bytes())
    (d2 / "extra.bin").write_bytes(b"more")
    assert model_version(d2, LAYOUT) == model_version(d, LAYOUT)


def test_model_version_config_tokenizer_and_layout(tmp_path):
    d = _model_dir(tmp_path / "m")
    base = model_version(d, LAYOUT)
    assert model_version(d, PageLayout(2, 2, 8, block_size=8)) != base
    assert model_version(d, PageLayout(2, 2, 8, block_size=4, dtype="bfloat16")) != base
    assert model_version(d, PageLayout(3, 2, 8, block_size=4)) != base
    (d / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    tok = model_version(d, LAYOUT)
    assert tok != base
    (d / "config.json").write_text('{"hidden_size": 65}')
    assert model_version(d, LAYOUT) not in (base, tok)


def test_model_version_explicit_version_overrides_weights(tmp_path):
    d = _model_dir(tmp_path / "m")
    e1 = model_version(d, LAYOUT, version="release-7")
    (d / "model.safetensors").write_bytes(b"x" * 5)
    assert model_version(d, LAYOUT, version="release-7") == e1
    assert model_version(d, LAYOUT, version="release-8") != e1
    assert model_version(d, LAYOUT) != e1
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert len(model_version(empty, LAYOUT, version="v")) == 64
    with pytest.raises(NotFoundError):
        model_version(empty, LAYOUT)
    with pytest.raises(NotFoundError):
        model_version(tmp_path / "missing", LAYOUT)


def test_model_version_memo_avoids_rehash(tmp_path):
    d = _model_dir(tmp_path / "m", b"w" * (3 << 20))
    memo = tmp_path / "memo.json"
    real_open = open
    reads: list[str] = []

    def counting_open(path, *a, **kw):
        if str(path).endswith("model.safetensors"):
            reads.append(str(path))
        return real_open(path, *a, **kw)

    with mock.patch("builtins.open", counting_open):
        v1 = model_version(d, LAYOUT, memo_path=memo)
        assert len(reads) == 1
        assert model_version(d, LAYOUT, memo_path=memo) == v1
        assert len(reads) == 1, "memo hit must not re-read the weights"
        os.utime(d / "model.safetensors", ns=(10**18, 10**18))  # mtime changed: re-hash
        assert model_version(d, LAYOUT, memo_path=memo) == v1
        assert len(reads) == 2
    memo.write_text("not json")  # a damaged memo only costs a re-hash
    assert model_version(d, LAYOUT, memo_path=memo) == v1


def test_store_block_extra_separates_blocks(make_store):
    store = make_store()
    tokens = toks(5, 2)
    img_a, img_b = [["img:a"]], [["img:b"]]
    store.put(tokens, pages_for(tokens, block_extra=img_a), SCOPE, block_extra=img_a)
    assert store.lookup(tokens, SCOPE, block_extra=img_a).num_blocks == 2
    assert store.lookup(tokens, SCOPE, block_extra=img_b).num_blocks == 0
    assert store.lookup(tokens, SCOPE).num_blocks == 0
    with store.acquire(tokens, SCOPE, block_extra=img_a) as lease:
        assert lease.num_blocks == 2
        from .kit import assert_lease_exact

        assert_lease_exact(lease)
