"""``tierkv chat``: an interactive multi-turn conversation on top of the store.

One user message per line of standard input (an empty line is skipped; ``/exit`` or end of
input ends the chat). After each answer a line reports the tokens reused from the store and
the time to first token; with ``--json`` each turn is one JSON object per line instead.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import click

from ..hf import SamplingConfig
from ..hf.chat import ChatTurn, Conversation
from .common import home_option, json_option, open_store, socket_option, warn
from .layouts import check_prefix
from .main_job import load_model, model_options

EXIT_COMMANDS = ("/exit", "/quit")


def _report(turn: ChatTurn, as_json: bool, number: int) -> None:
    if as_json:
        import json

        click.echo(json.dumps({
            "turn": number, "text": turn.text, "tokens": list(turn.tokens), "prompt_tokens": turn.prompt_tokens,
            "cached_tokens": turn.cached_tokens, "stored_blocks": turn.stored_blocks,
            "ttft_s": round(turn.ttft_s, 6), "total_s": round(turn.total_s, 6)}))
        return
    click.echo(f"assistant> {turn.text}")
    click.echo(f"  [turn {number}: reused {turn.cached_tokens} of {turn.prompt_tokens} prompt tokens, "
               f"TTFT {turn.ttft_s * 1000:.1f} ms, {len(turn.tokens)} new tokens, "
               f"{turn.stored_blocks} blocks stored]", err=True)


@click.command()
@model_options()
@click.option("--prefix", "prefix_name", default=None, help="Start the conversation after the prefix materialised as NAME.")
@click.option("--system", default=None, help="A system message opening the conversation.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Per answer.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Sample among the k most likely tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling.")
@click.option("--no-store-output", is_flag=True, help="Do not store the answers' blocks (the prompts' still are).")
@click.option("--namespace", default=None,
              help="Tenant salt of the block keys [default: the prefix's namespace, else 'default'].")
@home_option
@socket_option
@json_option
def chat(model_dir: Path, dtype: str, block_size: int, device: str | None, new_layout: bool, prefix_name: str | None,
         system: str | None, max_new_tokens: int, temperature: float, top_k: int | None, seed: int, no_store_output: bool,
         namespace: str | None, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Chat with a model, one message per line of input; each turn reuses the previous
    turns (prompts and answers) from the store. Uses the model's chat template when its
    tokenizer has one, else a plain "User:/Assistant:" format."""
    from ..materialize import load_prefix

    lm = load_model(model_dir, dtype, block_size, device)
    stdin = sys.stdin
    interactive = stdin.isatty()
    with contextlib.ExitStack() as stack:
        if prefix_name:
            check_prefix(home, socket_path, prefix_name, lm)  # before a store opens (issue #37, item 2)
        store: Any = stack.enter_context(open_store(home, lm.layout, socket_path, new_layout=new_layout))
        prefix: list[int] = []
        ns = namespace or "default"
        if prefix_name:
            loaded = load_prefix(store, lm, prefix_name, on_warning=warn)
            prefix, ns = loaded.tokens, namespace or loaded.namespace
        conversation = Conversation(lm, store=store, namespace=ns, prefix_tokens=prefix, system=system,
                                    max_new_tokens=max_new_tokens,
                                    sampling=SamplingConfig(temperature=temperature, top_k=top_k, seed=seed),
                                    store_output=not no_store_output, on_store_error=warn)
        if interactive:
            fmt = "the model's chat template" if conversation.uses_template else 'a plain "User:/Assistant:" format'
            click.echo(f"chatting in {fmt}{f' after prefix {prefix_name!r}' if prefix_name else ''}; "
                       f"/exit or Ctrl-D ends", err=True)
        number = 0
        while True:
            if interactive:
                click.echo("you> ", nl=False, err=True)
            line = stdin.readline()
            if not line or line.strip() in EXIT_COMMANDS:
                break
            if not line.strip():
                continue
            number += 1
            _report(conversation.ask(line.rstrip("\n")), as_json, number)


def register(group: click.Group) -> None:
    group.add_command(chat)
