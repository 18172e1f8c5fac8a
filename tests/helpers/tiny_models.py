"""Tiny causal LMs for tests: 2 layers, hidden 64, GQA, random init, saved as Hugging Face
model directories with a BPE tokenizer trained here (nothing downloaded)."""
from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

from tierkv.quickstart import train_tokenizer

ARCHS = ("llama", "qwen2", "mistral")
_WORDS = ("store block page tier host disk device lease key hash model token prefix cache "
          "def class return import self index write read fsync commit evict pin").split()


def corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + "\n" for _ in range(n_lines)]


@functools.lru_cache(maxsize=None)
def tokenizer(vocab_size: int = 384):
    return train_tokenizer(corpus(), vocab_size)


def config(arch: str, vocab_size: int, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
           context: int = 1024):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                  bos_token_id=0, eos_token_id=1)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        # A window shorter than the test prompts, so the sliding-window path is exercised.
        return MistralConfig(sliding_window=48, **common)
    raise ValueError(arch)


def make_model(arch: str = "llama", *, vocab_size: int | None = None, dtype: torch.dtype = torch.float32,
               seed: int = 0, attn: str = "sdpa", **shape):
    from transformers import AutoModelForCausalLM

    # Embedding rows rounded up past the tokenizer, as real checkpoints do: AutoTokenizer may
    # add a special token of the architecture (Qwen2's <|endoftext|>) when it loads the files.
    cfg = config(arch, vocab_size or (len(tokenizer()) + 64) // 64 * 64, **shape)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def save_model_dir(path: Path, arch: str = "llama", *, dtype: torch.dtype = torch.float32, seed: int = 0,
                   vocab_size: int | None = None, **shape) -> Path:
    """A model directory: weights, config and the test tokenizer."""
    model = make_model(arch, vocab_size=vocab_size, dtype=dtype, seed=seed, **shape)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path
