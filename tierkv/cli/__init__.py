"""The ``tierkv`` command. Each module here defines commands and a ``register(group)``
function; adding a module means adding one ``register`` call below."""
from __future__ import annotations

import click

from .. import __version__
from . import main_job
from .common import TierKVGroup


@click.group(cls=TierKVGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="tierkv")
def main() -> None:
    """tierkv: a tiered KV-cache store for LLM serving."""


main_job.register(main)

__all__ = ["main"]

from . import ops  # noqa: E402  (operations commands: tierkv/cli/ops.py)
ops.register(main)

from . import serve  # noqa: E402  (the daemon: tierkv/cli/serve.py)
serve.register(main)
from . import cluster  # noqa: E402,F401
