"""tierkv.hf: layout and version of a model, cached prefill equal to recomputation,
generation with and without the cache, and model-loading errors."""
from __future__ import annotations

import hashlib
import re

import pytest
import torch

from helpers import tiny_models
from tierkv.errors import ConfigError, InvalidTokensError, NotFoundError, PageFormatError
from tierkv.hf import (
    SamplingConfig,
    cached_prefill,
    generate,
    layout_from_config,
    layout_from_model,
    load_model,
    version_of,
)
from tierkv.identity import Scope
from tierkv.layout import PageLayout

pytestmark = pytest.mark.usefixtures("private_caches")

BS = 16
# fp32: a restored cache must give the logits of a full recomputation to 1e-5 (they agree to
# ~1e-7 in practice; chunked matmuls may round differently).
# bf16: values carry 8 significant bits, so the same computation split into chunks can differ
# by a few ulps of the logits' magnitude (~0.5 here): allow 2e-2 absolute.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def scope_for(name: str) -> Scope:
    return Scope(model_version=hashlib.sha256(name.encode()).hexdigest())


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def test_layout_from_config_handles_gqa_and_explicit_head_dim():
    cfg = tiny_models.config("qwen2", 300, layers=3, hidden=64, heads=4, kv_heads=2)
    assert layout_from_config(cfg, "float32") == PageLayout(3, 2, 16, 16, "float32")
    cfg = tiny_models.config("llama", 300, hidden=64, heads=4, kv_heads=1)
    cfg.head_dim = 32  # Gemma/Qwen3-style: head_dim independent of hidden / heads
    assert layout_from_config(cfg, "bfloat16", block_size=8) == PageLayout(2, 1, 32, 8, "bfloat16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_logits_after_cache_hit_equal_full_recompute(arch, dtype, store_factory):
    model = tiny_models.make_model(arch, dtype=dtype)
    store = store_factory(layout_from_model(model, BS))
    scope = scope_for(arch)
    # Lengths around a block multiple: all of them must still compute their last token.
    for n in (4 * BS - 1, 4 * BS, 4 * BS + 1, 100):
        tokens = prompt(n, seed=n)
        ref = full_logits(model, tokens)
        cold = cached_prefill(model, tokens, store=store, scope=scope, chunk_tokens=32)
        warm = cached_prefill(model, tokens, store=store, scope=scope, chunk_tokens=32)
        assert cold.cached_tokens == 0
        assert warm.cached_tokens == (n - 1) // BS * BS
        assert warm.computed_tokens == n - warm.cached_tokens >= 1
        assert warm.stored_blocks == 0
        torch.testing.assert_close(cold.logits, ref, atol=TOL[dtype], rtol=0)
        torch.testing.assert_close(warm.logits, ref, atol=TOL[dtype], rtol=0)
        assert warm.tokens_in_cache == n


def test_shared_prefix_is_reused_by_a_longer_prompt(store_factory):
    model = tiny_models.make_model("llama")
    store = store_factory(layout_from_model(model, BS))
    scope = scope_for("shared")
    head = prompt(40)
    made = cached_prefill(model, head, store=store, scope=scope, need_logits=False)
    assert (made.logits, made.stored_blocks, made.tokens_in_cache) == (None, 2, 32)
    again = cached_prefill(model, head, store=store, scope=scope, need_logits=False)
    assert again.computed_tokens == 0 and again.stored_blocks == 0
    longer = head + prompt(30, seed=1)
    warm = cached_prefill(model, longer, store=store, scope=scope)
    assert warm.cached_tokens == 32 and warm.stored_blocks == 2
    torch.testing.assert_close(warm.logits, full_logits(model, longer), atol=1e-5, rtol=0)
    assert store.lookup(longer, scope).tokens_matched == 64


def test_prefill_without_store_and_bad_input():
    model = tiny_models.make_model("llama")
    tokens = prompt(37)
    plain = cached_prefill(model, tokens, chunk_tokens=8)
    torch.testing.assert_close(plain.logits, full_logits(model, tokens), atol=1e-5, rtol=0)
    with pytest.raises(InvalidTokensError):
        cached_prefill(model, [])


def test_store_of_another_layout_is_refused(store_factory):
    model = tiny_models.make_model("llama")
    store = store_factory(PageLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=BS))
    with pytest.raises(PageFormatError):
        cached_prefill(model, prompt(40), store=store, scope=scope_for("x"))


def test_generation_is_identical_with_and_without_cache(store_factory):
    model = tiny_models.make_model("qwen2")
    store = store_factory(layout_from_model(model, BS))
    scope = scope_for("gen")
    tokens = prompt(80)
    cold = generate(model, tokens, max_new_tokens=6, eos_token_id=[])
    first = generate(model, tokens, store=store, scope=scope, max_new_tokens=6, eos_token_id=[])
    warm = generate(model, tokens, store=store, scope=scope, max_new_tokens=6, eos_token_id=[])
    assert cold.tokens == first.tokens == warm.tokens and len(warm.tokens) == 6
    assert (cold.cached_tokens, first.cached_tokens, warm.cached_tokens) == (0, 0, 64)
    assert first.stored_blocks == 5 and warm.stored_blocks == 0
    assert 0 < warm.ttft_s <= warm.total_s
    sampling = SamplingConfig(temperature=0.8, top_k=50, seed=7)
    s1 = generate(model, tokens, max_new_tokens=6, sampling=sampling, eos_token_id=[])
    s2 = generate(model, tokens, store=store, scope=scope, max_new_tokens=6, sampling=sampling, eos_token_id=[])
    assert s1.tokens == s2.tokens


def test_generation_stops_at_eos_and_context():
    model = tiny_models.make_model("llama", context=64)
    tokens = prompt(20)
    greedy_first = generate(model, tokens, max_new_tokens=1).tokens[0]
    assert generate(model, tokens, max_new_tokens=5, eos_token_id=greedy_first).tokens == (greedy_first,)
    assert len(generate(model, prompt(60), max_new_tokens=10, eos_token_id=[]).tokens) == 4
    with pytest.raises(ConfigError, match="64"):
        generate(model, prompt(64), max_new_tokens=1)


def test_load_model_derives_layout_and_version(llama_dir):
    lm = load_model(llama_dir)
    assert lm.layout == PageLayout(2, 2, 16, BS, "float32")
    assert version_of(llama_dir) == (lm.layout, lm.model_version)
    assert lm.context_length == 1024
    assert lm.encode_document("store block")[0] == lm.tokenizer.bos_token_id
    assert lm.encode_prompt("store block")[0] != lm.tokenizer.bos_token_id


def test_bf16_checkpoint_loads_in_bf16(tmp_path):
    d = tiny_models.save_model_dir(tmp_path / "bf16", "mistral", dtype=torch.bfloat16)
    lm = load_model(d)
    assert lm.layout.dtype == "bfloat16" and lm.model.dtype == torch.bfloat16
    assert load_model(d, dtype="float32").model_version != lm.model_version


def test_missing_and_non_model_directories(tmp_path):
    with pytest.raises(NotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_tokenizer_larger_than_embedding_warns_and_refuses_only_the_extra_tokens(tmp_path, caplog):
    d = tiny_models.save_model_dir(tmp_path / "small-vocab", "llama", vocab_size=100)
    with caplog.at_level("WARNING", logger="tierkv.hf.model"):
        lm = load_model(d)  # a warning, not an error: text without the extra tokens runs
    assert re.search(r"has \d+ tokens but the model embeds only 100", caplog.text)
    assert lm.embedding_rows == 100 and lm.check_ids([0, 5, 99]) == [0, 5, 99]
    words = tiny_models.corpus(50)
    high = next(w for line in words for w in line.split() if max(lm.tokenizer(w, add_special_tokens=False)["input_ids"]) >= 100)
    bad = max(lm.tokenizer(high, add_special_tokens=False)["input_ids"])
    name = lm.tokenizer.convert_ids_to_tokens(bad)
    with pytest.raises(InvalidTokensError, match=rf"token {re.escape(repr(name))} \(id {bad}\) is outside the model's embedding of 100 rows"):
        lm.encode_prompt(f"{high} {high}")
    with pytest.raises(InvalidTokensError):
        lm.encode_document(high)


def test_weight_change_gives_new_version_and_no_cached_tokens(tmp_path, store_factory):
    d = tiny_models.save_model_dir(tmp_path / "m", "llama", seed=0)
    lm = load_model(d)
    store = store_factory(lm.layout)
    tokens = prompt(64)
    cached_prefill(lm.model, tokens, store=store, scope=lm.scope(), need_logits=False)
    assert store.lookup(tokens, lm.scope()).tokens_matched == 64
    tiny_models.save_model_dir(d, "llama", seed=1)  # same shapes, other weights
    lm2 = load_model(d)
    assert lm2.layout == lm.layout and lm2.model_version != lm.model_version
    assert store.lookup(tokens, lm2.scope()).tokens_matched == 0
    assert generate(lm2.model, tokens, store=store, scope=lm2.scope(), max_new_tokens=1).cached_tokens == 0


def test_lease_kv_matches_lease_kv_for_scattered_and_consecutive_slots(store_factory):
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    store = store_factory(layout)
    scope = scope_for("slots")
    a, b = prompt(24, seed=1), prompt(16, seed=2)
    pages_a = torch.randn(6, *layout.shape)
    store.put(a[:16], pages_a[:4], scope)
    store.put(b, torch.randn(4, *layout.shape), scope)
    store.put(a, pages_a[4:], scope, start_block=4)  # a's last blocks land after b's
    from tierkv.hf import lease_kv

    for tokens in (a, b):
        with store.acquire(tokens, scope) as lease:
            mine, theirs = lease_kv(lease, layout), lease.kv()
        assert len(mine) == 2
        for (k1, v1), (k2, v2) in zip(mine, theirs):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_lease_kv_of_a_single_block_does_not_alias_the_pool(store_factory):
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    store = store_factory(layout)
    scope = scope_for("one-block")
    store.put(prompt(4), torch.randn(1, *layout.shape), scope)
    from tierkv.hf import lease_kv

    with store.acquire(prompt(4), scope) as lease:
        k, v = lease_kv(lease, layout)[0]
        pool = getattr(lease, "pool", None)
    if pool is not None:
        assert k.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()
    assert k.shape == (1, 2, 4, 8) and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restore_cache_in_windows_gives_the_stored_kv(dtype, store_factory, monkeypatch):
    """Windows of 2 blocks over 7 (scattered slots): each window copied while the next is
    leased; the cache holds exactly the stored KV, and nothing stays leased."""
    from types import SimpleNamespace

    from tierkv.hf import prefill, restore_cache
    from tierkv.layout import unpack_pages

    monkeypatch.setattr(prefill, "RESTORE_WINDOW_BLOCKS", 2)
    layout = PageLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    store = store_factory(layout)
    scope = scope_for(f"windows-{dtype}")
    a, b = prompt(28, seed=3), prompt(8, seed=4)
    pages = torch.randn(7, *layout.shape).to(layout.torch_dtype)
    store.put(a[:12], pages[:3], scope)
    store.put(b, torch.randn(2, *layout.shape).to(layout.torch_dtype), scope)
    store.put(a, pages[3:], scope, start_block=3)
    model = SimpleNamespace(device=torch.device("cpu"), dtype=layout.torch_dtype)
    for blocks in (7, 5, 1):
        r = restore_cache(store, a, scope, blocks, model)
        assert r.tokens == blocks * 4
        want = unpack_pages(pages[:blocks], layout)
        for layer, (k, v) in enumerate(want):
            assert torch.equal(r.cache.layers[layer].keys, k) and torch.equal(r.cache.layers[layer].values, v)
    assert store.stats()["leased_blocks"] == 0
    assert restore_cache(store, prompt(28, seed=9), scope, 7, model).tokens == 0
