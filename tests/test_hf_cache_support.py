"""Sliding-window and hybrid models (issue 14, item 3): a model whose layers are full or
sliding-window attention gives, on a cache hit past its window, the logits of recomputation
(fp32, 1e-5) and the tokens of transformers' own generate; any other cache is refused at
load with UnsupportedModelError naming the reason, never served."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner

from helpers import tiny_models
from tierkv.cli import main
from tierkv.errors import ConfigError, UnsupportedModelError
from tierkv.hf import cached_prefill, generate, layout_from_config, layout_from_model, load_model
from tierkv.hf.cache_support import attention_kinds, probe_cache
from tierkv.identity import Scope

pytestmark = pytest.mark.usefixtures("private_caches")

BS, WINDOW = 16, 24


def _common(**extra):
    d = dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    d.update(extra)
    return d


def sliding_config(kind: str):
    import transformers as t

    if kind == "qwen2-hybrid":  # layers >= max_window_layers slide: full, full, sliding, sliding
        return t.Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2))
    if kind == "gemma2":  # interleaved sliding/full, softcapping, own head_dim
        return t.Gemma2Config(**_common(sliding_window=WINDOW, head_dim=16))
    if kind == "gemma3":  # interleaved, local rope base for sliding layers
        return t.Gemma3TextConfig(**_common(sliding_window=WINDOW, head_dim=16, sliding_window_pattern=2))
    raise ValueError(kind)


def build(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", ["qwen2-hybrid", "gemma2", "gemma3"])
def test_sliding_window_hit_past_the_window_equals_recompute(kind, store_factory):
    cfg = sliding_config(kind)
    assert "sliding_attention" in attention_kinds(cfg)
    model = build(cfg)
    layout = layout_from_model(model, BS)
    probe_cache(model, layout)  # accepted
    store = store_factory(layout)
    scope = Scope(model_version=hashlib.sha256(kind.encode()).hexdigest())
    tokens = prompt(100)  # four windows long
    with torch.inference_mode():
        ref = model(torch.tensor([tokens])).logits[0, -1].float()
        windowless = build(type(cfg)(**{**cfg.to_dict(), "sliding_window": 4096})) \
            (torch.tensor([tokens])).logits[0, -1].float()
    assert (windowless - ref).abs().max() > 1e-3  # the window does change these logits
    cold = cached_prefill(model, tokens, store=store, scope=scope, chunk_tokens=32)
    warm = cached_prefill(model, tokens, store=store, scope=scope, chunk_tokens=32)
    assert warm.cached_tokens == 96 > WINDOW
    torch.testing.assert_close(cold.logits, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(warm.logits, ref, atol=1e-5, rtol=0)
    # Generating well past the window from a restored prefix gives transformers' own tokens
    # (its generate keeps a config-aware cache whose sliding layers drop old keys).
    mine = generate(model, tokens, store=store, scope=scope, max_new_tokens=12, eos_token_id=[])
    assert mine.cached_tokens == 96
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(tokens):].tolist()
    assert list(mine.tokens) == theirs


def refused_configs():
    import transformers as t

    return {
        "linear attention (Jamba)": (t.JambaConfig(**_common()), "linear_attention"),
        "chunked attention (Llama-4)": (t.Llama4TextConfig(**_common(attention_chunk_size=32)), "chunked_attention"),
        "KV shared across layers (Gemma-3n)": (t.Gemma3nTextConfig(**_common(num_kv_shared_layers=2)),
                                               "num_kv_shared_layers"),
        "latent attention (DeepSeek-V3)": (t.DeepseekV3Config(**_common(kv_lora_rank=16)), "kv_lora_rank"),
    }


@pytest.mark.parametrize("case", list(refused_configs()))
def test_other_caches_are_refused_with_the_reason(case):
    cfg, reason = refused_configs()[case]
    with pytest.raises(UnsupportedModelError, match=reason) as err:
        layout_from_config(cfg, "float32")
    assert isinstance(err.value, ConfigError) and "full or sliding-window" in str(err.value)


def test_load_refuses_before_loading_weights_and_the_cli_says_why(tmp_path):
    import transformers as t

    d = tmp_path / "jamba"
    d.mkdir()
    t.JambaConfig(**_common()).save_pretrained(d)  # no weights, no tokenizer: refused first
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        load_model(d)
    result = CliRunner().invoke(main, ["generate", "--model", str(d), "--prompt", "x", "--no-cache"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "linear_attention" in result.stderr and "full or sliding-window" in result.stderr
    model_version = CliRunner().invoke(main, ["model-version", str(d), "--json"])
    assert model_version.exit_code == 1 and "linear_attention" in model_version.stderr


def test_probe_refuses_a_model_that_swaps_in_its_own_cache():
    """What the config cannot tell: transformers' config-aware DynamicCache keeps sliding
    layers that drop keys older than the window; a model using it would store a cut cache."""
    from transformers import DynamicCache

    model = tiny_models.make_model("mistral")
    layout = layout_from_model(model, BS)
    probe_cache(model, layout)
    plain_forward = model.forward
    model.forward = lambda *a, **kw: plain_forward(*a, **{**kw, "past_key_values": DynamicCache(config=model.config)})
    with pytest.raises(UnsupportedModelError, match="replaced the DynamicCache"):
        probe_cache(model, layout)

    def fills_a_sliding_layer(*a, **kw):
        out = plain_forward(*a, **kw)
        given = kw["past_key_values"]
        given.layers[1] = DynamicCache(config=model.config).layers[1]
        return out

    model.forward = fills_a_sliding_layer
    with pytest.raises(UnsupportedModelError, match="layer 1"):
        probe_cache(model, layout)


def test_load_model_accepts_a_hybrid_model_dir(tmp_path):
    d = tmp_path / "qwen2-hybrid"
    build(sliding_config("qwen2-hybrid")).save_pretrained(d)
    tiny_models.tokenizer().save_pretrained(d)
    lm = load_model(d)
    assert lm.layout.num_layers == 4 and json.loads((d / "config.json").read_text())["sliding_window"] == WINDOW
