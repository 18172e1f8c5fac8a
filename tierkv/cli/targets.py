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


def model_versions_of(model_dir: Path, home: Path, store: "StoreAPI") -> list[str]:
    """Model versions of ``model_dir`` under every page layout the store it is used with
    serves: its own, or each of a daemon's (or a many-layout home's). A model's blocks may
    sit under any of them (block sizes differ), so invalidating or keeping a model means all
    of them; a version under a layout of another model matches no block. Before, a daemon
    serving several layouts fell back to the local default home's layout (issue #32:
    `invalidate --model M --socket S` failed, "holds no tierkv store")."""
    from ..layout import PageLayout
    from ..model_version import model_version

    import tierkv

    if store.layout is not None:
        layouts = [store.layout]
    else:
        per = store.stats(namespace_limit=1).get("layouts") or {}
        layouts = [PageLayout.from_dict(s["layout"]) for s in per.values() if s.get("layout")]
        if not layouts:
            layouts = [tierkv.home_layout(home)]
    return list(dict.fromkeys(model_version(model_dir, lo, memo_path=default_memo_path()) for lo in layouts))


def check_model_version(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        Scope(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model-version") from None
    return value.lower()
