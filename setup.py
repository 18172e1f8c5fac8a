"""Build hook (the project is configured in pyproject.toml).

1. Wheels get the modules of the top-level kernels/ directory copied into tierkv/kernels/.
   kernels/ has no __init__.py so that, from the repository root, it never shadows the
   Hugging Face ``kernels`` package; tierkv/kernels/__init__.py reaches it through
   ``__path__`` in a source tree or an editable install, and finds the copies in an
   installed wheel.
2. The store's metadata path (tierkv/compiled.py's MODULES) is compiled to C with mypyc, the
   mypy project's compiler of type-annotated Python. The same .py files stay the source of
   truth: without a C compiler, with ``TIERKV_PURE_PYTHON=1``, or in an editable install
   without ``TIERKV_COMPILE=1``, the build skips them and the package runs as plain Python.
   Either way the build records what it did in the manifest (tierkv/compiled.py,
   ``MANIFEST``), which tierkv/native.py reads at import and ``tierkv --version`` reports:
   pip shows this script's warnings only with -v. tierkv/native.py also refuses compiled
   modules whose sources changed after the build (an editable install keeps them beside
   the .py files).
   Why compiled, and what it buys: docs/performance-history.md, "Compiled metadata path".
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# The list of compiled modules and the decision to compile live in tierkv/compiled.py (one
# place for setup.py, tierkv/native.py and the tests). Loaded by path: importing the tierkv
# package would import torch, which the build environment does not have.
compiled = runpy.run_path(str(ROOT / "tierkv" / "compiled.py"))
SOURCES = {m: compiled["source"](m) for m in compiled["MODULES"]}  # module -> path from the root
PLAN = compiled["plan"](sys.argv[1:], os.environ)
# What this run decided when it did not compile (BuildPy records it): None when it compiles
# (BuildExt records the outcome) or builds nothing.
NOT_BUILT: dict | None = None


def warn(message: str) -> None:
    # stderr, which pip shows only with -v: the manifest keeps the outcome for tierkv --version.
    print(f"\ntierkv: WARNING: {message}\n", file=sys.stderr)


def short(reason: str, limit: int = 160) -> str:
    # A compiler's error carries its whole command line: tierkv --version shows one line.
    return reason if len(reason) <= limit else reason[:limit] + "... (pip install -v shows the rest)"


def read_manifest(package_dir: Path) -> object:
    try:
        return json.loads((package_dir / compiled["MANIFEST"]).read_text())
    except (OSError, ValueError):
        return None


def write_manifest(package_dir: Path, manifest: dict) -> None:
    package_dir.mkdir(parents=True, exist_ok=True)
    (package_dir / compiled["MANIFEST"]).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        if NOT_BUILT is not None:  # in the source tree for an editable install, else in the wheel
            package_dir = ROOT / "tierkv" if editable else Path(self.build_lib) / "tierkv"
            if not compiled["keeps_earlier_build"](read_manifest(package_dir), PLAN):
                write_manifest(package_dir, NOT_BUILT)
        if editable:
            return  # an editable install reads kernels/ in place
        dest = Path(self.build_lib) / "tierkv" / "kernels"
        for src in sorted((ROOT / "kernels").glob("*.py")):
            self.copy_file(str(src), str(dest / src.name))


class BuildExt(build_ext):
    """Builds the mypyc extensions, then records the hash of each compiled source beside
    them (tierkv/native.py compares it at import). A failed compile leaves plain Python, and
    a manifest that says why."""

    def run(self) -> None:
        if not self.extensions:
            super().run()
            return
        # Where the extensions go: the source tree (editable) or build_lib (wheel).
        out = Path(self.get_ext_fullpath(compiled["MODULES"][0])).parent
        try:
            super().run()
        except Exception as exc:  # no compiler, no headers: the pure-Python package still works
            warn(f"compiling the metadata path failed ({exc}); installing it as plain Python")
            write_manifest(out, compiled["not_built"](short(f"{type(exc).__name__}: {exc}"), failed=True))
            return
        digests = {m: hashlib.sha256((ROOT / path).read_bytes()).hexdigest() for m, path in SOURCES.items()}
        write_manifest(out, compiled["built"](digests))


def native_extensions() -> list:
    """mypyc's extensions for this run, or [] with NOT_BUILT set to the reason."""
    global NOT_BUILT
    if not PLAN.compile:
        if PLAN.reason != "not a build command":
            NOT_BUILT = compiled["not_built"](PLAN.reason, failed=False)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        warn("mypyc is not available; installing the metadata path as plain Python")
        NOT_BUILT = compiled["not_built"](f"mypyc not available ({exc})", failed=True)
        return []
    # Third-party packages (numpy, torch...) need not be in the build environment: their
    # types are Any to the compiler, which then checks nothing about them at run time.
    # mypy prints its errors to stdout: kept, so the manifest can name the first one.
    printed = io.StringIO()
    try:
        # Errors in modules that are imported but not compiled are not the compiler's concern.
        # group_name: the modules' shared C library is tierkv._metadata__mypyc, inside the
        # package (the default, a top-level module named by a hash, is not importable
        # through an editable install, which maps only the package).
        with contextlib.redirect_stdout(printed):
            return mypycify(["--ignore-missing-imports", "--follow-imports=silent", *SOURCES.values()],
                            opt_level="3", group_name="tierkv._metadata")
    except (Exception, SystemExit) as exc:  # a type error: mypy has printed it
        errors = [line for line in printed.getvalue().splitlines() if ": error:" in line]
        first = errors[0] if errors else repr(exc)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        NOT_BUILT = compiled["not_built"](short(f"mypyc: {first}") + more, failed=True)
        warn(f"mypyc refused the metadata path ({first}{more}); installing it as plain Python")
        return []
    finally:
        sys.stdout.write(printed.getvalue())  # as mypyc would have printed it


setup(cmdclass={"build_py": BuildPy, "build_ext": BuildExt}, ext_modules=native_extensions())
