"""The ``tierkv`` command. Each module here defines commands and a ``register(group)``
function; adding a module means adding one ``register`` call below."""
from __future__ import annotations

import click

from . import main_job
from .common import TierKVGroup


@click.group(cls=TierKVGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tierkv", message="tierkv %(version)s")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM serving."""


main_job.register(main)

__all__ = ["main"]
