"""Operations commands: ``invalidate``, ``stats``, ``ls``, ``pin``/``unpin``, ``verify``,
``gc``, ``export`` and ``import``.

Each command opens its target with :func:`open_target` (the home directly, or a running
daemon with ``--socket``), calls the library and prints a table, or one JSON object with
``--json``. The logic lives in the library (tierkv.core.operations, tierkv.home.gc, tierkv.bundle).

The commands live in inspection.py (stats, ls, verify), mutation.py (invalidate, pin, unpin,
gc) and bundles.py (export, import); targets.py holds what they share. This module collects
them for ``tierkv.cli`` and keeps their import path (``tierkv.cli.ops.verify``).
"""
from __future__ import annotations

import click

from .bundles import export_cmd, import_cmd
from .common import open_target
from .inspection import ls, stats, verify
from .mutation import gc, invalidate, pin, unpin
from .targets import target


COMMANDS = (invalidate, stats, ls, pin, unpin, verify, gc, export_cmd, import_cmd)


def register(group: click.Group) -> None:
    for command in COMMANDS:
        group.add_command(command)


__all__ = ["COMMANDS", "open_target", "register", "target"]
