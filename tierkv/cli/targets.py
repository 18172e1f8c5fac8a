"""What every operations command shares: opening its target (the home, or a daemon with
``--socket``), the ``--home``/``--socket``/``--json`` options, and model-version arguments."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import click

from ..identity import Scope
from ..model_version import default_memo_path
from .common import home_option, json_option, open_target, socket_option

if TYPE_CHECKING:
    from ..api import StoreAPI

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def target(home: Path, socket_path: Path | None, **options: Any) -> Iterator["StoreAPI"]:
    t = open_target(home, socket_path, **options)
    try:
        yield t
    finally:
        t.close()


def target_options(f: F) -> F:
    return home_option(socket_option(json_option(f)))


# ---- formatting ------------------------------------------------------------------------
def short(hex_str: str | None, n: int = 12) -> str:
    return (hex_str or "-")[:n]


def model_version_of(model_dir: Path, home: Path, store: "StoreAPI") -> str:
    """Model version of ``model_dir`` under the layout of the store (or home) it is used with."""
    from ..model_version import model_version

    import tierkv

    layout = store.layout or tierkv.home_layout(home)  # a client of a daemon serving several: the home's
    return model_version(model_dir, layout, memo_path=default_memo_path())


def check_model_version(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        Scope(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model-version") from None
    return value.lower()
