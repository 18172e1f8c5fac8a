"""Which of tierkv's modules run compiled, and the guard that keeps stale ones out.

setup.py compiles the store's metadata path (tierkv/compiled.py's MODULES) to C with mypyc
and writes MANIFEST beside the package: the Python tag it was built for and the SHA-256 of
each compiled source, or why it left plain Python (skipped on purpose, or a failed compile;
pip shows the build's own warning only with -v, so this is where the reason survives).
An editable install leaves the compiled modules next to their .py files,
and Python imports an extension module before a source file of the same name, so after an
edit (or a ``git checkout``) the old compiled code would run in place of the new source.
:func:`install_guard` (called first thing by ``tierkv/__init__.py``) compares each source
with the manifest and, if any differs, or the manifest is missing or for another Python,
or lists other modules than MODULES, or ``TIERKV_PURE_PYTHON=1`` is set, makes every
compiled module import from its .py (all or none: compiled classes cannot be mixed with
sources of another version). The reason is in :func:`status` and ``tierkv --version``, and
logged once; ``TIERKV_COMPILE=1 pip install -e .`` rebuilds.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Mapping, Sequence

from .compiled import MANIFEST, MODULES, ON_PURPOSE, PURE_REQUESTED, flag

log = logging.getLogger(__name__)

REBUILD = "TIERKV_COMPILE=1 pip install -e ."  # what brings an editable install's build back
PACKAGE_DIR = Path(__file__).resolve().parent

_state: dict[str, object] = {"compiled": [], "reason": "not checked"}


def _compiled_files(package_dir: Path) -> list[Path]:
    """Extension modules inside the package (a compiled build's leftovers included)."""
    out: list[Path] = []
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        out.extend(package_dir.rglob(f"*{suffix}"))
    return sorted(set(out))


def _source(root: Path, module: str) -> Path:
    return root / (module.replace(".", "/") + ".py")


def check(package_dir: Path = PACKAGE_DIR, env: Mapping[str, str] | None = None,
          present: Sequence[Path] | None = None, expected: Sequence[str] | None = None) -> tuple[list[str], str]:
    """(modules that may run compiled, why not the others): compiled modules are used only
    when present, built for this Python, from the sources as they are now, and (``expected``)
    as the modules of the list; tierkv's own package is held to tierkv/compiled.py's list.
    ``present``: the package's extension files, when the caller has listed them."""
    env = os.environ if env is None else env
    present = _compiled_files(package_dir) if present is None else present
    if expected is None and package_dir == PACKAGE_DIR:
        # Under this package's own name: scripts/replay_ab.py imports another revision's
        # tierkv as tierkv_base, its manifest naming tierkv_base's modules.
        package = __name__.rpartition(".")[0]
        expected = [package + m[m.index("."):] for m in MODULES]
    if flag(env, "TIERKV_PURE_PYTHON"):
        return [], PURE_REQUESTED
    try:
        manifest = json.loads((package_dir / MANIFEST).read_text())
    except FileNotFoundError:
        if not present:  # a source tree on sys.path, never built
            return [], "no compiled modules in this install"
        return [], f"{MANIFEST} is missing: compiled modules not trusted; rebuild with {REBUILD}"
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and "failed" in manifest:
        return [], f"compile failed: {manifest['failed']}"
    if isinstance(manifest, dict) and "plain" in manifest:
        return [], str(manifest["plain"])  # skipped on purpose (tierkv/compiled.py, plan)
    try:
        sources: dict[str, str] = dict(manifest["sources"])
        tag = manifest["python"]
    except (KeyError, TypeError, ValueError):
        return [], f"{MANIFEST} is unreadable: compiled modules not trusted; rebuild with {REBUILD}"
    if not present:
        return [], "no compiled modules in this install (the manifest lists some: deleted since?)"
    if tag != sys.implementation.cache_tag:
        return [], f"compiled for {tag}, running {sys.implementation.cache_tag}"
    if expected is not None and set(sources) != set(expected):
        return [], f"the compiled module list changed since the build: plain Python until {REBUILD} rebuilds"
    root = package_dir.parent
    for module, digest in sorted(sources.items()):
        path = _source(root, module)
        try:
            now = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return [], f"{path} is missing"
        if now != digest:
            return [], f"{path.name} changed since the compiled build: plain Python until {REBUILD} rebuilds"
    return sorted(sources), "compiled modules match their sources"


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Imports the named tierkv modules from their .py files, never from an extension."""

    def __init__(self, modules: Sequence[str], root: Path) -> None:
        self.modules, self.root = frozenset(modules), root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, _source(self.root, fullname))


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).as_posix()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if rel.endswith(suffix):
            rel = rel[: -len(suffix)]
            break
    return rel.replace("/", ".")


def install_guard(package_dir: Path = PACKAGE_DIR) -> importlib.abc.MetaPathFinder | None:
    """Decide once per process which modules run compiled (see the module docstring);
    returns the finder it put first on ``sys.meta_path``, if any."""
    present = _compiled_files(package_dir)  # one scan of the package per import
    compiled, reason = check(package_dir, present=present)
    _state.update(compiled=compiled, reason=reason)
    root = package_dir.parent
    # Every extension with a source beside it that the manifest does not vouch for: all of
    # them when the build is not trusted, else leftovers of an earlier build (a module
    # since taken off the compiled list; an in-place rebuild does not delete it).
    stale = [m for m in (_module_name(p, root) for p in present) if m not in compiled and _source(root, m).exists()]
    if not stale:
        return None
    finder = _SourceFirst(stale, root)
    sys.meta_path.insert(0, finder)
    if not compiled and reason not in ON_PURPOSE:
        log.warning("tierkv: running the metadata path as plain Python: %s", reason)
    return finder


def describe() -> str:
    """One line for ``tierkv --version``: "compiled: 8 modules", or "plain Python: <why>"."""
    compiled = _state["compiled"]
    return f"compiled: {len(compiled)} modules" if compiled else f"plain Python: {_state['reason']}"  # type: ignore[arg-type]


def status() -> dict[str, object]:
    """``{"compiled": [modules], "reason": str}`` for this process (also in Store.stats())."""
    return {"compiled": list(_state["compiled"]), "reason": _state["reason"]}  # type: ignore[call-overload]


def running_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension (a test of the guard's outcome)."""
    return any(str(module.__file__).endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)
