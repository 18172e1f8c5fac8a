"""The compiled path's contract in one place: which modules mypyc compiles, when a build
compiles them, and what the build records about it.

Three readers: ``setup.py`` (what to build, and whether), ``tierkv/native.py`` (what an
install should hold, at import) and the tests (``tests/test_compiled.py`` type-checks these
modules with ``mypy --strict``). setup.py runs before tierkv can be imported (torch and
numpy are not in the build environment), so it loads this file by its path: it uses the
standard library only and imports nothing from tierkv.

Why a module and not a data file (a text or JSON list): a wheel ships it with no
package-data entry, mypy sees the list's type, and the build decision sits beside the list
it decides about. Moving the compiled modules into a subpackage was set aside: another
reorganisation of the packages is planned (issue #32).
"""
from __future__ import annotations

import sys
from typing import Mapping, NamedTuple, Sequence

# The modules a put, a lookup and an eviction run through, per block (issue #12's replay,
# the daemon's requests), and ``faults``, whose unarmed checks they call (a call between
# compiled modules is a C call). Each must pass ``mypy --strict``: the compiled code checks
# argument and attribute types at run time where plain Python would not. A compiled class
# cannot be patched at run time, nor its calls to its own methods hooked: tests make these
# modules fail or crash at named fault points instead (tierkv/core/faults.py).
MODULES: tuple[str, ...] = (
    "tierkv.checksum", "tierkv.core.blocks", "tierkv.core.faults", "tierkv.core.holds", "tierkv.core.ingest",
    "tierkv.core.leasing", "tierkv.core.matching", "tierkv.core.placement", "tierkv.core.policy",
    "tierkv.core.policy_leader", "tierkv.core.policy_lru2_order", "tierkv.core.policy_mix", "tierkv.core.policy_shadows",
    "tierkv.tiers.base",
)
MANIFEST = "_native.json"  # written by setup.py beside the package; read by tierkv/native.py

# The setup.py commands that build extensions. pip runs setup.py three times for one install
# (the build requirements, the metadata, the build): only the last needs mypyc's minutes.
BUILD_COMMANDS = frozenset({"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"})
# An editable install (PEP 660's editable_wheel; the legacy develop) builds into the source
# tree, where every later edit of a compiled module makes the build stale: compiling there
# is opt-in (TIERKV_COMPILE=1), so that the common edit-test loop costs no rebuilds.
EDITABLE_COMMANDS = frozenset({"editable_wheel", "develop"})
EDITABLE_SKIPPED = "editable install without TIERKV_COMPILE=1"
PURE_REQUESTED = "TIERKV_PURE_PYTHON=1"
PURE_AT_INSTALL = f"{PURE_REQUESTED} at install"
# Plain Python asked for, not a fault: tierkv/native.py warns about the other reasons only.
ON_PURPOSE = frozenset({EDITABLE_SKIPPED, PURE_REQUESTED, PURE_AT_INSTALL})


class BuildPlan(NamedTuple):
    """Whether this setup.py run compiles; ``reason`` says why not ("" when it does)."""

    compile: bool
    reason: str


def source(module: str) -> str:
    """The source file of ``module``, relative to the repository root (or site-packages)."""
    return module.replace(".", "/") + ".py"


def flag(env: Mapping[str, str], name: str) -> bool:
    """An on/off environment variable: set and neither empty nor "0"."""
    return env.get(name, "") not in ("", "0")


def plan(argv: Sequence[str], env: Mapping[str, str]) -> BuildPlan:
    """What a setup.py run with arguments ``argv`` (without the script name) builds:
    wheels compile unless ``TIERKV_PURE_PYTHON=1``; editable installs only with
    ``TIERKV_COMPILE=1``; commands that build nothing (egg_info, dist_info) never."""
    commands = set(argv)
    if not commands & BUILD_COMMANDS:
        return BuildPlan(False, "not a build command")
    if flag(env, "TIERKV_PURE_PYTHON"):
        return BuildPlan(False, PURE_AT_INSTALL)
    if commands & EDITABLE_COMMANDS and not flag(env, "TIERKV_COMPILE"):
        return BuildPlan(False, EDITABLE_SKIPPED)
    return BuildPlan(True, "")


def keeps_earlier_build(earlier: object, plan: BuildPlan) -> bool:
    """Whether a run that does not compile leaves the manifest ``earlier`` of the same tree
    as it is: an editable install skipping the compile keeps a build made before with
    TIERKV_COMPILE=1 (tierkv/native.py still checks it against the sources at every
    import). Else a second editable install of one tree, such as scripts/ci_vllm.sh's venv,
    would turn the first one's compiled modules off."""
    return plan.reason == EDITABLE_SKIPPED and isinstance(earlier, dict) and "sources" in earlier


def built(digests: Mapping[str, str]) -> dict[str, object]:
    """The manifest of a build that compiled: the Python it is for and each source's SHA-256."""
    return {"python": sys.implementation.cache_tag, "sources": dict(digests)}


def not_built(reason: str, failed: bool) -> dict[str, object]:
    """The manifest of a build that left plain Python: skipped on purpose (``plain``) or
    because compiling failed (``failed``), so that ``tierkv --version`` can say which."""
    return {"python": sys.implementation.cache_tag, ("failed" if failed else "plain"): reason}
