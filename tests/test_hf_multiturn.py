"""Multi-turn (issue 14, item 4): generate stores the blocks its answer completed, so the next
turn's prompt, which repeats the answer, restores through it; a hit through blocks whose KV
was computed during decode gives the logits of a full recomputation (fp32: 1e-5)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from helpers import tiny_models
from tierkv.hf import cache_layer_kv, cached_prefill, generate, layout_from_model
from tierkv.identity import Scope

BS = 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # as tests/test_hf.py


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: sliding window 48, exceeded here
def test_second_turn_hits_through_the_first_answer(arch, dtype, store_factory):
    model = tiny_models.make_model(arch, dtype=dtype)
    store = store_factory(layout_from_model(model, BS))
    scope = Scope(model_version=hashlib.sha256(f"mt-{arch}".encode()).hexdigest())
    turn1 = prompt(40)
    first = generate(model, turn1, store=store, scope=scope, max_new_tokens=40, eos_token_id=[])
    # 40 prompt + 39 answer tokens with KV: blocks 0-1 from the prefill, 2-3 from decode.
    assert (first.stored_blocks, first.stored_output_blocks) == (2, 2)
    turn2 = turn1 + list(first.tokens) + prompt(10, seed=1)
    warm = generate(model, turn2, store=store, scope=scope, max_new_tokens=8, eos_token_id=[])
    cold = generate(model, turn2, max_new_tokens=8, eos_token_id=[])
    assert warm.cached_tokens == 64 > len(turn1)
    torch.testing.assert_close(warm.first_logits, full_logits(model, turn2), atol=TOL[dtype], rtol=0)
    assert warm.tokens == cold.tokens


def test_decode_kv_is_close_to_prefill_kv_and_the_last_token_is_not_stored(store_factory):
    """The stored answer blocks hold decode-computed KV: equal to a prefill's up to float
    rounding (fp32), so storing them keeps every hit within the hit tolerance."""
    model = tiny_models.make_model("qwen2")
    store = store_factory(layout_from_model(model, BS))
    scope = Scope(model_version=hashlib.sha256(b"mt-kv").hexdigest())
    turn1 = prompt(30)
    out = generate(model, turn1, store=store, scope=scope, max_new_tokens=35, eos_token_id=[])
    seq = turn1 + list(out.tokens)
    assert len(seq) == 65 and out.stored_output_blocks == 3  # 64 tokens with KV: block 0 from the prefill, 1-3 after
    assert store.lookup(seq, scope).num_blocks == 4
    with store.acquire(seq, scope) as lease:
        stored = lease.kv()
    prefilled = cache_layer_kv(cached_prefill(model, seq[:64], need_logits=False).cache)
    worst = max(float((a - b).abs().max()) for (k1, v1), (k2, v2) in zip(stored, prefilled)
                for a, b in ((k1, k2), (v1, v2)))
    assert worst < 1e-5
    # A longer second turn restores all four blocks and matches recomputation.
    turn2 = seq + prompt(5, seed=2)
    again = cached_prefill(model, turn2, store=store, scope=scope)
    assert again.cached_tokens == 64
    torch.testing.assert_close(again.logits, full_logits(model, turn2), atol=1e-5, rtol=0)


def test_no_store_output_and_no_store_new_store_no_answer(store_factory):
    model = tiny_models.make_model("llama")
    store = store_factory(layout_from_model(model, BS))
    scope = Scope(model_version=hashlib.sha256(b"mt-off").hexdigest())
    turn1 = prompt(40)
    off = generate(model, turn1, store=store, scope=scope, max_new_tokens=40, eos_token_id=[], store_output=False)
    assert (off.stored_blocks, off.stored_output_blocks) == (2, 0)
    assert store.lookup(turn1 + list(off.tokens), scope).num_blocks == 2
    scope2 = Scope(model_version=hashlib.sha256(b"mt-off-2").hexdigest())
    none = generate(model, turn1, store=store, scope=scope2, max_new_tokens=40, eos_token_id=[], store_new=False)
    assert (none.stored_blocks, none.stored_output_blocks) == (0, 0)
    assert store.lookup(turn1 + list(none.tokens), scope2).num_blocks == 0
    # An answer that ends inside the prompt's last block completes no block: nothing to store.
    short = generate(model, prompt(20, seed=3), store=store, scope=scope, max_new_tokens=5, eos_token_id=[])
    assert (short.stored_blocks, short.stored_output_blocks) == (1, 0)
