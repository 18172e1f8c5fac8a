"""A multi-turn conversation whose every turn restores the previous turns from the store.

Each turn's prompt is the whole conversation so far, rendered with the model's chat template
when its tokenizer has one, else in a plain format (``User: ...`` / ``Assistant:...``), and
put after an optional materialised prefix. :func:`tierkv.hf.generate` stores the blocks of
the prompt and of the answer, so the next turn hits through both.

A hit needs the same token ids, not the same text: re-tokenizing the rendered conversation
would not give back the ids the model generated (a BPE model may emit ``"st" "ore"`` where
the tokenizer writes ``"store"``). So the conversation keeps its token ids: when the new
rendering extends the text those ids stand for, only the extension is tokenized and
appended (what the tokenizer would do to the whole text is not needed for correctness: the
model attends to these ids, cached or not). When it does not (a template that rewrites
earlier turns, e.g. one that strips an answer's spaces), the whole rendering is tokenized
again and the store serves what still matches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .generate import GREEDY, SamplingConfig, generate

if TYPE_CHECKING:
    from ..api import StoreAPI
    from .model import LoadedModel


@dataclass(frozen=True)
class ChatTurn:
    """One answered turn: ``cached_tokens`` of the ``prompt_tokens`` came from the store;
    ``stored_blocks`` were newly written (prompt and answer blocks)."""

    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    stored_blocks: int
    ttft_s: float
    total_s: float


def render_plain(messages: Sequence[dict[str, str]]) -> str:
    """The plain format for models without a chat template; ends ready for the answer. An
    answer is rendered right after ``Assistant:`` exactly as decoded, so a rendering
    extends the previous one."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"{m['content']}\n")
        elif m["role"] == "user":
            parts.append(f"User: {m['content']}\n")
        else:
            parts.append(f"Assistant:{m['content']}\n")
    parts.append("Assistant:")
    return "".join(parts)


class Conversation:
    """A chat with ``lm`` over an optional ``prefix_tokens`` (a materialised prefix).

    Not thread-safe; one conversation per user. ``store`` (a Store or daemon client) may be
    None: nothing is then cached. The answer of each turn is stored unless ``store_output``
    is False. ``on_store_error``: a failing disk does not end the turn (tierkv.hf.generate).
    """

    def __init__(self, lm: "LoadedModel", *, store: "StoreAPI | None" = None, namespace: str = "default",
                 prefix_tokens: Sequence[int] = (), system: str | None = None, max_new_tokens: int = 128,
                 sampling: SamplingConfig = GREEDY, store_output: bool = True,
                 on_store_error: Callable[[str], None] | None = None) -> None:
        self.lm = lm
        self.store = store
        self.namespace = namespace
        self.prefix_tokens = [int(t) for t in prefix_tokens]
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.store_output = store_output
        self.on_store_error = on_store_error
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.uses_template = bool(getattr(lm.tokenizer, "chat_template", None))
        self._text = ""  # the rendered text that self._tokens stand for (after the prefix)
        self._tokens: list[int] = []

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The conversation as text, ending where the assistant's answer starts."""
        if self.uses_template:
            return str(self.lm.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                             add_generation_prompt=True))
        return render_plain(messages)

    def _encode(self, text: str, first: bool) -> list[int]:
        # A template writes its own special tokens (BOS included) into the text; the plain
        # format gets the tokenizer's, unless it follows a prefix document that has them.
        special = first and not self.uses_template and not self.prefix_tokens
        return self.lm.check_ids(self.lm.tokenizer(text, add_special_tokens=special)["input_ids"]) if text else []

    def prompt_tokens(self, user_text: str) -> tuple[str, list[int]]:
        """The next turn's rendered conversation (ending with ``user_text`` and the start of
        the answer) and its prompt's token ids (the prefix's first)."""
        rendered = self.render([*self.messages, {"role": "user", "content": user_text}])
        if self._tokens and rendered.startswith(self._text):
            conversation = self._tokens + self._encode(rendered[len(self._text):], first=False)
        else:
            conversation = self._encode(rendered, first=True)
        return rendered, self.prefix_tokens + conversation

    def ask(self, user_text: str) -> ChatTurn:
        """Answer ``user_text``; raises ConfigError when the conversation outgrows the
        model's context (start a new conversation)."""
        rendered, tokens = self.prompt_tokens(user_text)
        scope = self.lm.scope(self.namespace) if self.store is not None else None
        result = generate(self.lm.model, tokens, store=self.store, scope=scope, max_new_tokens=self.max_new_tokens,
                          sampling=self.sampling, eos_token_id=self._eos(), store_output=self.store_output,
                          on_store_error=self.on_store_error)
        answer = list(result.tokens)
        eos = self._eos()
        if answer and answer[-1] in eos:
            answer = answer[:-1]  # the template (or plain format) writes the end of the turn itself
        text = self.lm.decode(answer)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        # The answer's own ids stand for its text from now on, even where decoding loses
        # something (special tokens skipped, bytes that are not UTF-8): they are what the
        # model generated and what the store holds the KV of.
        self._text, self._tokens = rendered + text, tokens[len(self.prefix_tokens):] + answer
        return ChatTurn(text=text, tokens=tuple(result.tokens), prompt_tokens=result.prompt_tokens,
                        cached_tokens=result.cached_tokens,
                        stored_blocks=result.stored_blocks + result.stored_output_blocks,
                        ttft_s=result.ttft_s, total_s=result.total_s)

    def _eos(self) -> list[int]:
        ids: set[int] = set()
        for source in (getattr(self.lm.model, "generation_config", None), self.lm.tokenizer):
            value: Any = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif value is not None:
                ids.update(int(v) for v in value)
        return sorted(ids)
