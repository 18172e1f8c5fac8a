"""The ``tierkv`` command. Each module here defines commands and a ``register(group)``
function; adding a module means adding one ``register`` call below."""
from __future__ import annotations

import click

from .. import __version__, native
from . import chat, cluster, config_show, doctor, keys, layouts, main_job, materialize, ops, serve
from .common import TierKVGroup


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    # What runs is read when asked, not when this module was imported: the import guard's
    # state can change in between (a test reloading it, a rebuild in a long session).
    if value and not ctx.resilient_parsing:
        click.echo(f"tierkv {__version__} ({native.describe()})")
        ctx.exit()


@click.group(cls=TierKVGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version, whether the metadata path runs compiled, and exit.")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM serving."""


for module in (main_job, materialize, ops, layouts, serve, config_show, doctor, cluster, keys, chat):
    module.register(main)

__all__ = ["main"]
