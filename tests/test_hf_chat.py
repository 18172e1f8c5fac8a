"""tierkv.hf.chat.Conversation: every turn's prompt extends the previous prompt and answer
token for token, so the store serves both; the answers are those of an uncached
conversation; plain format and chat template."""
from __future__ import annotations

import pytest

from tierkv.hf.chat import Conversation, render_plain

pytestmark = pytest.mark.usefixtures("private_caches")

BS = 16
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
QUESTIONS = ("store the block", "evict the page", "pin the prefix")


def run(conversation: Conversation) -> list:
    return [conversation.ask(q) for q in QUESTIONS]


def expected_hit(turn) -> int:
    # The previous prompt and all its answer tokens but the last (no KV yet), in full blocks.
    return (turn.prompt_tokens + len(turn.tokens) - 1) // BS * BS


def test_plain_format_hits_through_answers_and_matches_uncached(llama_lm, store_factory):
    assert not Conversation(llama_lm).uses_template
    cached = run(Conversation(llama_lm, store=store_factory(llama_lm.layout), max_new_tokens=24))
    plain = run(Conversation(llama_lm, max_new_tokens=24))
    assert [t.tokens for t in cached] == [t.tokens for t in plain]
    assert [t.prompt_tokens for t in cached] == [t.prompt_tokens for t in plain]
    assert cached[0].cached_tokens == 0
    for before, turn in zip(cached, cached[1:]):
        assert turn.cached_tokens == expected_hit(before) > before.prompt_tokens - BS
        assert turn.stored_blocks > 0
    assert render_plain([{"role": "user", "content": "a"}, {"role": "assistant", "content": " b"}]) == \
        "User: a\nAssistant: b\nAssistant:"


def test_chat_template_and_no_store_output(llama_lm, store_factory, tmp_path):
    llama_lm.tokenizer.chat_template = TEMPLATE
    try:
        conversation = Conversation(llama_lm, store=store_factory(llama_lm.layout), system="you store blocks",
                                    max_new_tokens=24)
        assert conversation.uses_template
        rendered, tokens = conversation.prompt_tokens("hi")
        assert rendered.startswith("<s>system\nyou store blocks</s>\n") and tokens[0] == llama_lm.tokenizer.bos_token_id
        turns = run(conversation)
        for before, turn in zip(turns, turns[1:]):
            assert turn.cached_tokens == expected_hit(before)
        # The same conversation without storing answers hits only through prompt blocks.
        other = Conversation(llama_lm, store=store_factory(llama_lm.layout, home=tmp_path / "other"),
                             system="you store blocks", max_new_tokens=24, store_output=False)
        off = run(other)
        assert [t.tokens for t in off] == [t.tokens for t in turns]
        assert off[1].cached_tokens == (off[0].prompt_tokens // BS) * BS < turns[1].cached_tokens
    finally:
        llama_lm.tokenizer.chat_template = None


def test_a_prefix_is_reused_by_every_turn(llama_lm, store_factory):
    from tierkv.hf import cached_prefill

    store = store_factory(llama_lm.layout)
    prefix = llama_lm.encode_document("store block page tier host disk device lease key hash " * 6)
    cached_prefill(llama_lm.model, prefix, store=store, scope=llama_lm.scope(), need_logits=False)
    turns = run(Conversation(llama_lm, store=store, prefix_tokens=prefix, max_new_tokens=8))
    assert turns[0].cached_tokens == len(prefix) // BS * BS > 0
    assert turns[0].prompt_tokens > len(prefix)
    assert all(t.cached_tokens >= turns[0].cached_tokens for t in turns)
