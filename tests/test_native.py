"""The compiled metadata path (setup.py builds it with mypyc; tierkv/native.py guards it): a
compiled module is used only when it was built from the sources as they are now, and the
compiled and plain-Python stores behave the same."""
from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers.ci import skip_outside_ci

import tierkv
import tierkv.core.blocks
import tierkv.core.ingest
from tierkv import compiled, native
from tierkv.core.policy import POLICIES

ROOT = Path(__file__).resolve().parents[1]
EXT = importlib.machinery.EXTENSION_SUFFIXES[0]


def fake_package(tmp_path: Path, name: str, value: int) -> Path:
    """A package ``name`` with a module ``mod`` (VALUE = value) and, beside it, an
    "extension module" of the same name that is not a valid shared object: importing it
    fails, so an import that succeeds came from the .py."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(f"VALUE = {value}\n")
    (pkg / f"mod{EXT}").write_bytes(b"not a shared object")
    return pkg


def write_manifest(pkg: Path, name: str, tag: str | None = None) -> None:
    digest = hashlib.sha256((pkg / "mod.py").read_bytes()).hexdigest()
    (pkg / native.MANIFEST).write_text(json.dumps(
        {"python": tag or sys.implementation.cache_tag, "sources": {f"{name}.mod": digest}}))


def test_compiled_modules_are_trusted_only_when_built_from_the_current_sources(tmp_path):
    pkg = fake_package(tmp_path, "pkg_a", 1)
    compiled, reason = native.check(pkg, env={})
    assert compiled == [] and "missing" in reason  # an extension without a manifest
    write_manifest(pkg, "pkg_a")
    assert native.check(pkg, env={}) == (["pkg_a.mod"], "compiled modules match their sources")
    assert native.check(pkg, env={"TIERKV_PURE_PYTHON": "1"})[0] == []
    assert native.check(pkg, env={"TIERKV_PURE_PYTHON": "0"})[0] == ["pkg_a.mod"]
    (pkg / "mod.py").write_text("VALUE = 2\n")  # an edit after the build
    compiled, reason = native.check(pkg, env={})
    assert compiled == [] and "mod.py changed" in reason
    write_manifest(pkg, "pkg_a", tag="cpython-299")  # built for another Python
    compiled, reason = native.check(pkg, env={})
    assert compiled == [] and "cpython-299" in reason
    (pkg / f"mod{EXT}").unlink()
    assert native.check(pkg, env={})[0] == []


def test_the_guard_imports_a_stale_module_from_its_source(tmp_path, monkeypatch):
    pkg = fake_package(tmp_path, "pkg_b", 7)
    write_manifest(pkg, "pkg_b")
    (pkg / "mod.py").write_text("VALUE = 8\n")  # the source moved on; the "build" did not
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError):  # without the guard, the stale extension is what loads
        importlib.import_module("pkg_b.mod")
    sys.modules.pop("pkg_b.mod", None)
    finder = native.install_guard(pkg)
    try:
        assert finder is not None
        mod = importlib.import_module("pkg_b.mod")
        assert mod.VALUE == 8 and mod.__file__.endswith("mod.py")
    finally:
        sys.meta_path.remove(finder)
        for name in ("pkg_b.mod", "pkg_b"):
            sys.modules.pop(name, None)
        native.install_guard()  # this process's own state back


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


@pytest.mark.skipif(os.environ.get("TIERKV_PURE_PYTHON", "") not in ("", "0"), reason="plain Python asked for")
def test_the_metadata_path_runs_compiled_where_there_is_a_compiler():
    if _compiler() is None:
        pytest.skip("no C compiler: this install is plain Python by design")
    state = native.status()
    if state["reason"] == compiled.EDITABLE_SKIPPED:  # a developer's install; CI builds with TIERKV_COMPILE=1
        skip_outside_ci(f"{state['reason']}: plain Python by choice")
    assert native.running_compiled(tierkv.core.blocks) and native.running_compiled(tierkv.core.ingest), state["reason"]
    assert state["compiled"] == sorted(compiled.MODULES)  # the one list, all of it
    for name in compiled.MODULES:
        assert native.running_compiled(importlib.import_module(name)), name


def _replay(env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "replay_trace.py"), "--generated", "zipf-scan",
         "--capacity", "100", "--capacity", "500", "--reference", "lru", "--check-model", "--json"],
        env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def test_plain_python_and_compiled_stores_give_the_same_hits():
    compiled = _replay({"TIERKV_PURE_PYTHON": "0"})
    plain = _replay({"TIERKV_PURE_PYTHON": "1"})
    assert plain["native"]["compiled"] == []
    assert compiled["native"]["compiled"] == native.check(env={})[0]  # this install's build, if any
    rows = lambda r: [(x["capacity"], x["policy"], x["block_hit_rate"]) for x in r["rows"] if x["kind"] == "store"]  # noqa: E731
    assert rows(compiled) == rows(plain) and len(rows(plain)) == 2 * len(POLICIES)  # 2 capacities x every policy


def test_a_leftover_extension_that_the_manifest_does_not_list_imports_from_source(tmp_path, monkeypatch):
    # An in-place rebuild does not delete the extension of a module taken off the compiled
    # list: the manifest vouches only for the others.
    monkeypatch.delenv("TIERKV_PURE_PYTHON", raising=False)  # the guard reads the environment
    pkg = fake_package(tmp_path, "pkg_c", 3)
    (pkg / "gone.py").write_text("VALUE = 4\n")
    (pkg / f"gone{EXT}").write_bytes(b"not a shared object either")
    write_manifest(pkg, "pkg_c")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = native.install_guard(pkg)
    try:
        assert finder is not None and finder.modules == {"pkg_c.gone"}
        assert native.status()["compiled"] == ["pkg_c.mod"]
        assert importlib.import_module("pkg_c.gone").VALUE == 4
    finally:
        sys.meta_path.remove(finder)
        for name in ("pkg_c.gone", "pkg_c"):
            sys.modules.pop(name, None)
        native.install_guard()


def test_the_manifest_says_why_a_build_left_plain_python(tmp_path):
    """pip hides setup.py's warnings without -v: the manifest is where a skipped or failed
    compile is reported (tierkv --version shows it)."""
    pkg = fake_package(tmp_path, "pkg_d", 5)
    (pkg / native.MANIFEST).write_text(json.dumps(compiled.not_built("CompileError: command 'gcc' failed", failed=True)))
    assert native.check(pkg, env={}) == ([], "compile failed: CompileError: command 'gcc' failed")
    (pkg / native.MANIFEST).write_text(json.dumps(compiled.not_built(compiled.EDITABLE_SKIPPED, failed=False)))
    assert native.check(pkg, env={}) == ([], "editable install without TIERKV_COMPILE=1")
    (pkg / f"mod{EXT}").unlink()  # the usual case: nothing was built at all
    assert native.check(pkg, env={}) == ([], "editable install without TIERKV_COMPILE=1")
    assert native.check(pkg, env={"TIERKV_PURE_PYTHON": "1"}) == ([], "TIERKV_PURE_PYTHON=1")
    (pkg / native.MANIFEST).unlink()
    assert native.check(pkg, env={}) == ([], "no compiled modules in this install")


def test_a_build_of_another_module_list_is_not_trusted(tmp_path):
    # A checkout that adds a module to tierkv/compiled.py's list, over a build of the old list.
    pkg = fake_package(tmp_path, "pkg_e", 6)
    write_manifest(pkg, "pkg_e")
    assert native.check(pkg, env={}, expected=["pkg_e.mod"])[0] == ["pkg_e.mod"]
    compiled_now, reason = native.check(pkg, env={}, expected=["pkg_e.mod", "pkg_e.other"])
    assert compiled_now == [] and "module list changed" in reason and native.REBUILD in reason


def test_version_names_what_runs(monkeypatch):
    from click.testing import CliRunner

    from tierkv.cli import main

    out = CliRunner().invoke(main, ["--version"]).output.strip()
    state = native.status()
    if state["compiled"]:
        assert out == f"tierkv {tierkv.__version__} (compiled: {len(compiled.MODULES)} modules)"
    else:
        assert out == f"tierkv {tierkv.__version__} (plain Python: {state['reason']})"
    monkeypatch.setitem(native._state, "compiled", [])
    monkeypatch.setitem(native._state, "reason", "compile failed: mypyc: x.py:1: error: boom")
    assert native.describe() == "plain Python: compile failed: mypyc: x.py:1: error: boom"
