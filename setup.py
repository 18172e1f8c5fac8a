"""Build hook (the project is configured in pyproject.toml).

1. Wheels get the modules of the top-level kernels/ directory copied into tierkv/kernels/.
   kernels/ has no __init__.py so that, from the repository root, it never shadows the
   Hugging Face ``kernels`` package; tierkv/kernels/__init__.py reaches it through
   ``__path__`` in a source tree or an editable install, and finds the copies in an
   installed wheel.
2. The store's metadata path (COMPILED below) is compiled to C with mypyc, the
   mypy project's compiler of type-annotated Python. The same .py files stay the source of
   truth: without a C compiler, or with ``TIERKV_PURE_PYTHON=1``, the build skips them and
   the package runs as plain Python; tierkv/native.py refuses compiled modules whose
   sources changed after the build (an editable install keeps them beside the .py files).
   Why compiled, and what it buys: docs/performance-history.md, "Compiled metadata path".
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# The modules a put, a lookup and an eviction run through, per block (issue #12's replay,
# the daemon's requests). Each must type-check under mypy: the compiled code checks
# argument and attribute types at run time where plain Python would not.
# Not placement.py: the crash and fault tests hook its methods (tests/store/child.py), and
# calls inside a compiled class bypass a hook set on the class.
COMPILED = [
    "tierkv.blocks", "tierkv.checksum", "tierkv.holds", "tierkv.ingest", "tierkv.leasing",
    "tierkv.policy", "tierkv.policy_mix", "tierkv.tiers.base",
]
SOURCES = {m: m.replace(".", "/") + ".py" for m in COMPILED}  # module -> path from the root
MANIFEST = "_native.json"  # = tierkv.native.MANIFEST (tierkv itself cannot be imported here)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads kernels/ in place
        dest = Path(self.build_lib) / "tierkv" / "kernels"
        for src in sorted((ROOT / "kernels").glob("*.py")):
            self.copy_file(str(src), str(dest / src.name))


class BuildExt(build_ext):
    """Builds the mypyc extensions, then records the hash of each compiled source beside
    them (tierkv/native.py compares it at import). A failed compile leaves plain Python."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, no headers: the pure-Python package still works
            print(f"tierkv: compiling the metadata path failed ({exc}); installing it as plain Python",
                  file=sys.stderr)
            return
        if not self.extensions:
            return
        # Where tierkv/blocks's extension went: the source tree (editable) or build_lib (wheel).
        out = Path(self.get_ext_fullpath("tierkv.blocks")).parent
        digests = {m: hashlib.sha256((ROOT / path).read_bytes()).hexdigest() for m, path in SOURCES.items()}
        (out / MANIFEST).write_text(json.dumps({"python": sys.implementation.cache_tag, "sources": digests},
                                               indent=1, sort_keys=True) + "\n")


# The commands that build extensions. pip runs setup.py three times for one install (the
# build requirements, the metadata, the build): only the last needs mypyc's minute of work.
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def native_extensions() -> list:
    if os.environ.get("TIERKV_PURE_PYTHON", "") not in ("", "0") or not _BUILDS & set(sys.argv[1:]):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("tierkv: mypyc not available; installing the metadata path as plain Python", file=sys.stderr)
        return []
    # Third-party packages (numpy, torch...) need not be in the build environment: their
    # types are Any to the compiler, which then checks nothing about them at run time.
    try:
        # Errors in modules that are imported but not compiled are not the compiler's concern.
        # group_name: the modules' shared C library is tierkv._metadata__mypyc, inside the
        # package (the default, a top-level module named by a hash, is not importable
        # through an editable install, which maps only the package).
        return mypycify(["--ignore-missing-imports", "--follow-imports=silent", *SOURCES.values()], opt_level="3",
                        group_name="tierkv._metadata")
    except (Exception, SystemExit) as exc:  # a type error: mypy has printed it
        print(f"tierkv: mypyc refused the metadata path ({exc!r}); installing it as plain Python",
              file=sys.stderr)
        return []


setup(cmdclass={"build_py": BuildPy, "build_ext": BuildExt}, ext_modules=native_extensions())
