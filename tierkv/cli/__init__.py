"""The ``tierkv`` command. Each module here defines commands and a ``register(group)``
function; adding a module means adding one ``register`` call below."""
from __future__ import annotations

import click

from .. import __version__, native
from . import chat, cluster, config_show, doctor, keys, layouts, main_job, materialize, ops, serve
from .common import TierKVGroup


@click.group(cls=TierKVGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="tierkv",
                      message="%(prog)s %(version)s (" + native.describe().replace("%", "%%") + ")")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM serving."""


for module in (main_job, materialize, ops, layouts, serve, config_show, doctor, cluster, keys, chat):
    module.register(main)

__all__ = ["main"]
