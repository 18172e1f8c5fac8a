"""What every tierkv command shares: the group that renders errors, ``--home``, ``--json``,
opening the store, and printing results.

This is the only place besides the command modules that reads the environment
(``TIERKV_HOME``); library code takes every setting as an argument.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

import click
from click.core import ParameterSource

from ..config import HOME_ENV, SOCKET_ENV, default_home
from ..errors import LayoutMismatchError, TierKVError
from ..layout import PageLayout, layout_fix

if TYPE_CHECKING:
    from ..api import StoreAPI
    from ..daemon import Client

F = TypeVar("F", bound=Callable[..., Any])


class TierKVGroup(click.Group):
    """A click group that turns a TierKVError into a one-line message (with its hint) and
    exit status 1 instead of a traceback. Other exceptions are bugs and keep theirs."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TierKVError as exc:
            raise click.ClickException(exc.for_command_line()) from exc


def home_option(f: F) -> F:
    return click.option(
        "--home",
        type=click.Path(file_okay=False, path_type=Path),
        envvar=HOME_ENV,
        default=default_home,
        show_default=f"${HOME_ENV}, else $XDG_DATA_HOME/tierkv or ~/.local/share/tierkv",
        help="Store home directory.",
    )(f)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")(f)


def socket_option(f: F) -> F:
    """``--socket``, for a command that also takes ``--home``: the command receives the
    socket :func:`chosen_socket` picks (None: open the home)."""

    @functools.wraps(f)
    def choosing(*args: Any, **kwargs: Any) -> Any:
        kwargs["socket_path"] = chosen_socket(click.get_current_context(), kwargs.get("socket_path"))
        return f(*args, **kwargs)

    return click.option(
        "--socket", "socket_path", type=click.Path(dir_okay=False, path_type=Path), envvar=SOCKET_ENV, default=None,
        help=f"Go through the tierkv daemon listening here instead of opening --home [env {SOCKET_ENV}; "
             "an explicit --home beats the environment].",
    )(choosing)  # type: ignore[return-value]


def chosen_socket(ctx: click.Context, socket_path: Path | None) -> Path | None:
    """Which target a command acts on, ``--home`` or ``--socket`` (issue #37, item 1): an
    explicit flag beats the environment, so ``TIERKV_SOCKET`` set in the shell does not
    redirect ``--home h1`` (a destructive command would act on the daemon's home); both
    flags given is an error naming both. From the environment alone (``TIERKV_SOCKET``, with
    or without ``TIERKV_HOME``) the socket wins: the daemon owns its home."""
    explicit = ParameterSource.COMMANDLINE
    home_src, socket_src = ctx.get_parameter_source("home"), ctx.get_parameter_source("socket_path")
    if socket_path is None:
        return None
    if home_src is explicit and socket_src is explicit:
        raise click.UsageError(f"--home {ctx.params.get('home')} and --socket {socket_path} both name a target: "
                               "pass one (--socket goes through the daemon serving its own home)")
    if home_src is explicit:
        return None  # TIERKV_SOCKET from the environment: the explicit --home wins
    return socket_path


def connect_daemon(socket_path: Path, layout: PageLayout | None = None) -> "Client":
    """A client of the daemon at ``socket_path`` (the Store API). ``layout`` is declared to
    the daemon, which opens a store for it on first use (one daemon serves every model);
    without it the client is for operations (or the daemon's only layout)."""
    import tierkv

    client = tierkv.connect(socket_path, layout=layout)
    if layout is not None and client.layout != layout:  # a daemon of an older tierkv
        client.close()
        raise LayoutMismatchError(
            f"the daemon at {socket_path} serves pages of layout {client.layout}, this model needs {layout.to_json()}",
            hint="upgrade the daemon (it then serves every layout), or drop --socket",
        )
    return client


def open_store(home: Path, layout: PageLayout, socket_path: Path | None = None, *, new_layout: bool = False,
               **options: Any) -> "StoreAPI":
    """The store for ``layout``: a client of the daemon at ``socket_path`` when given, else
    the home opened in this process; ``options`` are StoreConfig fields given on the
    command line (None means the store's default). A layout the target does not hold is
    LayoutMismatchError unless ``new_layout`` (or the target holds none yet): see
    tierkv/cli/layouts.py."""
    import tierkv

    from ..home.budgets import check_fits, command_limits, limit_options
    from ..home.directory import find_layouts, layout_id, store_home

    require_layout(home, socket_path, layout, new_layout)
    if socket_path is not None:
        return connect_daemon(socket_path, layout)
    # The layout's own store in a home that holds several (as the daemon would open it):
    # flags over TIERKV_* over $TIERKV_CONFIG (tierkv/daemon/config/resolve.py, DIRECT_KEYS).
    from ..daemon import direct_store_options

    opts = {**direct_store_options(os.environ), **{k: v for k, v in options.items() if v is not None}}
    # Its share of the home's budgets, as a daemon gives the one layout in use: the memory
    # tiers whole, the disk divided among every layout the home holds (home/budgets.py).
    lid = layout_id(layout)
    ids = list(dict.fromkeys([layout_id(lo) for _, lo in find_layouts(home)] + [lid]))
    share = command_limits(opts, ids, [lid])[lid]
    check_fits(lid, layout, share)
    return tierkv.open(store_home(home, layout), layout, **opts, **limit_options(share))


# The layout guard of open_store (issue #37, item 2; tierkv/cli/layouts.py says why). Here,
# not in layouts.py: open_store calling into that module made an import cycle through
# targets.py.
def held_layouts(home: Path, socket_path: Path | None) -> list[PageLayout]:
    """The layouts of the stores ``home`` holds (read without opening them), or those the
    daemon at ``socket_path`` serves."""
    from ..home.directory import find_layouts

    if socket_path is None:
        return [lo for _, lo in find_layouts(home)]
    with connect_daemon(socket_path) as client:
        per = client.stats(namespace_limit=1).extra.get("layouts") or {}
    return [PageLayout.from_dict(s["layout"]) for s in per.values() if s.get("layout")]


def require_layout(home: Path, socket_path: Path | None, layout: PageLayout, new_layout: bool) -> None:
    """Raise LayoutMismatchError when the target holds stores, none of ``layout``, and
    ``new_layout`` is not set; the message names the fields that differ from the closest
    layout held, the hint the options that would match it."""
    from ..home.directory import layout_id

    held = held_layouts(home, socket_path)
    if new_layout or not held or layout in held:
        return
    closest = min(held, key=lambda lo: len(layout.differences(lo)))
    where = f"the daemon at {socket_path}" if socket_path is not None else str(home)
    raise LayoutMismatchError(
        f"{where} holds no store of page layout {layout_id(layout)}; against its {layout_id(closest)} this model "
        f"has {', '.join(layout.differences(closest))}",
        hint=f"{layout_fix(layout, closest, 'the home')}, or pass --new-layout to make a store for this layout "
             "(`tierkv layouts` lists them)")


# Operations need the disk tier only: keep the memory tiers in (sparse) host memory, so an
# ops command neither initialises CUDA nor takes GPU memory from a serving process.
OPS_STORE_OPTIONS: dict[str, Any] = {"device": "cpu", "host_bytes": 0}


def open_target(home: Path, socket_path: Path | None, **options: Any) -> "StoreAPI":
    """Every store of ``home`` (each page layout it holds, opened here as one target:
    :class:`~tierkv.home.Home`), or, with ``socket_path``, a client of the
    daemon serving it; both answer the same across layouts. ``options`` are StoreConfig
    fields for a home opened here. Raises NotFoundError for a home without a store,
    DaemonOwnsHomeError when a daemon holds the home, DaemonUnavailableError when the
    daemon cannot be reached."""
    from ..home.home import Home

    if socket_path is not None:
        return connect_daemon(socket_path)
    # The home's budgets as the daemon would read them (TIERKV_* over $TIERKV_CONFIG), so
    # each layout gets the share a daemon gives it; the tiers an operation needs no more of
    # (OPS_STORE_OPTIONS) stay small.
    from ..daemon import direct_store_options

    return Home.open(home, **{**direct_store_options(os.environ), **OPS_STORE_OPTIONS, **options})


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(rows: Iterable[tuple[str, Any]]) -> None:
    """Two aligned columns: label, value."""
    rows = list(rows)
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        click.echo(f"{label:<{width}}  {format_value(value)}")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_columns(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """An aligned table with a header row (numbers right-aligned)."""
    cells = [[format_value(v) if not isinstance(v, str) else v for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(not isinstance(row[i], str) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    click.echo(line(headers))
    for r in cells:
        click.echo(line(r))


def emit(as_json: bool, obj: dict[str, Any], rows: Iterable[tuple[str, Any]] | None = None) -> None:
    """Print ``obj`` as one JSON line with ``--json``, else ``rows`` (default: obj's items)."""
    if as_json:
        click.echo(json.dumps(obj, sort_keys=True))
    else:
        print_table(rows if rows is not None else obj.items())


def progress_bar(desc: str, enabled: bool = True) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A tqdm bar on stderr (tokens, tokens/s, ETA) as a ``progress(done, total)`` callback,
    and a function that closes it (also closed by the update that reaches ``total``).

    While the bar is shown, log records (a "disk tier degraded" warning from the store)
    are printed through tqdm, on lines of their own above the bar, not inside it."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if not enabled:
            return
        bar = state.get("bar")
        if bar is None:
            redirect = state["redirect"] = logging_redirect_tqdm(tqdm_class=tqdm)
            redirect.__enter__()
            bar = state["bar"] = tqdm(
                total=total, initial=done, desc=desc, unit="tok", unit_scale=True, file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1,
            )
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:  # finished: stop the clock before whatever the command does next
            close()

    def close() -> None:
        if "bar" in state:
            state.pop("bar").close()
            state.pop("redirect").__exit__(None, None, None)

    return update, close
