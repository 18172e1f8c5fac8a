"""The quickstart: a small model built locally, tierkv's own source as the prefix, one
question answered with and without the cache.

Nothing is downloaded. The model is a random-init Llama (weights are noise, so the answer
is too; what matters is that cold and warm runs produce the same tokens and how long each
takes to its first token) and its tokenizer a byte-level BPE trained with ``tokenizers`` on
tierkv's source files. Both are saved as an ordinary Hugging Face model directory, built
once under a directory the caller chooses (the CLI uses ``$TIERKV_HOME/quickstart``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from .document import DocumentOptions
from .hf.generate import generate
from .hf.model import LoadedModel
from .hf.prefill import Progress
from .materialize import load_prefix, materialize

if TYPE_CHECKING:
    from .api import StoreAPI

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_OPTIONS = DocumentOptions(include=("*.py", "*.md"))
DEFAULT_QUESTION = "\n\nQuestion: in what order does a put write a page and commit the index?\nAnswer:"
PREFIX_NAME = "quickstart"
BOS, EOS = "<s>", "</s>"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a small Llama-style model. The defaults make a ~7M-parameter model whose
    4k-token prefill takes seconds on two CPU cores, so a cache hit is visibly faster."""

    num_layers: int = 8
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    vocab_size: int = 4096
    context: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> object:
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic for the same texts),
    as a transformers fast tokenizer that prepends ``<s>`` when asked for special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def source_texts(root: Path = PACKAGE_DIR) -> list[str]:
    """Texts of the ``.py`` and ``.md`` files under ``root`` in sorted order."""
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".md") and p.is_file())
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build_tiny_model(out_dir: Path, texts: Iterable[str], spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Train a tokenizer on ``texts``, build a random-init Llama of ``spec`` and save both
    into ``out_dir``. Built in a temporary sibling directory and renamed into place, so a
    build interrupted half way never leaves a directory that looks complete."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(texts, spec.vocab_size)
    config = LlamaConfig(
        # Rounded up: AutoTokenizer may add an architecture's special token on load.
        vocab_size=(len(tokenizer) + 64) // 64 * 64,  # type: ignore[arg-type]
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.context,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.building-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def ensure_quickstart_model(directory: Path, spec: TinyModelSpec = TinyModelSpec()) -> tuple[Path, bool]:
    """The quickstart model directory under ``directory``, built on first use from
    tierkv's own source. Returns (model directory, whether it was built now)."""
    model_dir = directory / "model"
    if (model_dir / "config.json").is_file():
        return model_dir, False
    return build_tiny_model(model_dir, source_texts(), spec), True


@dataclass(frozen=True)
class QuickstartResult:
    prefix_tokens: int
    prompt_tokens: int
    cached_tokens: int
    materialize_s: float
    ttft_cold_s: float
    ttft_warm_s: float
    identical: bool
    text: str

    @property
    def speedup(self) -> float:
        return self.ttft_cold_s / self.ttft_warm_s if self.ttft_warm_s > 0 else float("inf")


def run_quickstart(
    store: "StoreAPI",
    lm: LoadedModel,
    *,
    source_dir: Path = PACKAGE_DIR,
    question: str = DEFAULT_QUESTION,
    max_tokens: int = 4096,
    max_new_tokens: int = 16,
    progress: Progress | None = None,
) -> QuickstartResult:
    """Materialise ``source_dir`` (cut to ``max_tokens``) as prefix ``quickstart``, then
    answer ``question`` after it twice, greedily: recomputing everything (cold) and from
    the store (warm). Returns both times to first token and whether the tokens agree."""
    limit = lm.context_length or max_tokens
    max_tokens = min(max_tokens, limit - len(lm.encode_prompt(question)) - max_new_tokens)
    made = materialize(store, lm, [source_dir], SOURCE_OPTIONS, name=PREFIX_NAME,
                       max_tokens=max_tokens, progress=progress)
    # The request is built as `tierkv generate --prefix quickstart` builds it.
    prefix = load_prefix(store, lm, PREFIX_NAME).tokens
    tokens = prefix + lm.encode_prompt(question)
    with torch.inference_mode():  # first-call overheads (allocator, kernels) out of the timing
        lm.model(input_ids=torch.tensor([tokens[:32]], device=lm.model.device))
    cold = generate(lm.model, tokens, max_new_tokens=max_new_tokens)
    warm = generate(lm.model, tokens, store=store, scope=lm.scope(), max_new_tokens=max_new_tokens, store_new=False)
    return QuickstartResult(
        prefix_tokens=len(prefix),
        prompt_tokens=len(tokens),
        cached_tokens=warm.cached_tokens,
        materialize_s=made.elapsed_s,
        ttft_cold_s=cold.ttft_s,
        ttft_warm_s=warm.ttft_s,
        identical=cold.tokens == warm.tokens,
        text=lm.decode(list(warm.tokens)),
    )
