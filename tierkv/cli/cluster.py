"""``tierkv route``: which node would serve a request from the most cached tokens.

Registered on the group by ``register`` (tierkv/cli/__init__.py). Parses, asks
:func:`tierkv.cluster.route` and prints.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from ..hf import DEFAULT_BLOCK_SIZE, DTYPE_CHOICES
from .common import emit, json_option, warn


class _Unreachable:
    """A node that could not be opened: its lookup raises the reason (reported per node)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


def _tokenizer_model(model_dir: Path, dtype: str, block_size: int) -> Any:
    """Tokenizer, layout and model version of ``model_dir``, without loading weights."""
    from transformers import AutoTokenizer

    from ..hf import version_of
    from ..hf.config import check_model_dir, context_length, load_config
    from ..hf.model import LoadedModel
    from ..model_version import default_memo_path

    root = check_model_dir(model_dir)
    layout, mv = version_of(root, dtype=dtype, block_size=block_size, memo_path=default_memo_path())
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {root}: {exc}") from exc
    return LoadedModel(model=None, tokenizer=tokenizer, layout=layout, model_version=mv, model_dir=root,
                       context_length=context_length(load_config(root)))


def _read_tokens(path: Path) -> list[int]:
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        data = text.split()
    try:
        return [int(x) for x in data]
    except (TypeError, ValueError):
        raise click.BadParameter(f"{path} must hold a JSON list of ints or whitespace-separated ints") from None


@click.command(name="route")
@click.option("--node", "node_specs", multiple=True, required=True,
              help="A node's daemon socket (repeatable); a store home directory also works.")
@click.option("--prefix", "prefix_name", default=None, help="Route a request that starts with prefix NAME.")
@click.option("--prompt", default=None, help="Request text (after --prefix, or the whole request).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Token ids of the request (JSON list or whitespace-separated).")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="Model directory: tokenizer and model version (weights are not loaded).")
@click.option("--model-version", default=None,
              help="Model version (64 hex) when routing --tokens-file without --model.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=DEFAULT_BLOCK_SIZE, show_default=True)
@click.option("--namespace", default=None,
              help="Tenant namespace of the request [default: the prefix's, else 'default'].")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds to wait for each node's answer.")
@json_option
def route_cmd(node_specs: tuple[str, ...], prefix_name: str | None, prompt: str | None, tokens_file: Path | None,
              model_dir: Path | None, model_version: str | None, dtype: str, block_size: int, namespace: str | None,
              timeout: float, as_json: bool) -> None:
    """Ask every --node how many tokens of a request it holds; print the best node."""
    from ..cluster import open_node, route
    from ..cluster.route import resolve_prefix
    from ..identity import Scope

    if tokens_file is not None and (prefix_name or prompt):
        raise click.UsageError("pass --tokens-file, or --prefix/--prompt, not both")
    if tokens_file is None and not (prefix_name or prompt):
        raise click.UsageError("pass --prefix NAME, --prompt TEXT or --tokens-file PATH")
    if model_dir is None and (prefix_name or prompt or model_version is None):
        raise click.UsageError("--model DIR is needed (or --model-version with --tokens-file)")
    lm = _tokenizer_model(model_dir, dtype, block_size) if model_dir is not None else None
    nodes: dict[str, Any] = {}
    for spec in node_specs:
        try:  # the model's layout picks its store on a node serving several
            nodes[spec] = open_node(spec, layout=lm.layout if lm is not None else None)
        except Exception as e:  # noqa: BLE001 - reported as that node's answer
            warn(f"node {spec}: {e}")
            nodes[spec] = _Unreachable(e)
    try:
        if tokens_file is not None:
            tokens = _read_tokens(tokens_file)
        else:
            assert lm is not None  # the usage checks above: --prefix and --prompt need --model
            if prefix_name:
                prefix = resolve_prefix(prefix_name, nodes, lm)
                tokens = prefix.tokens + (lm.encode_prompt(prompt) if prompt else [])
                namespace = namespace or prefix.namespace
            else:
                tokens = lm.encode_document(str(prompt))
        try:
            scope = Scope(model_version or lm.model_version, namespace or "default")  # type: ignore[union-attr]
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--model-version / --namespace") from None
        result = route(tokens, nodes, scope, timeout_s=timeout)
    finally:
        for node in nodes.values():
            close = getattr(node, "close", None)
            if close is not None:
                close()
    out = result.to_dict()
    rows: list[tuple[str, Any]] = [("best node", result.best_node or "(none answered)"),
                                   ("request tokens", result.tokens)]
    rows += [(f"  {a.node}", a.error or f"{a.cached_tokens} cached") for a in result.answers]
    emit(as_json, out, rows)


def register(group: click.Group) -> None:
    group.add_command(route_cmd)
