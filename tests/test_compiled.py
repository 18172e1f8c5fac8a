"""The compiled path's contract (tierkv/compiled.py): one list of compiled modules, which
all pass ``mypy --strict``; when a build compiles them; what setup.py does with the decision.
(tierkv/native.py's guard, which reads the build's manifest at import: tests/test_native.py.)"""
from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv import compiled

ROOT = Path(__file__).resolve().parents[1]


# ---- the build decision ----------------------------------------------------------------
@pytest.mark.parametrize("argv,env,expected", [
    (["bdist_wheel"], {}, (True, "")),  # pip install . / pip wheel .
    (["build_ext", "--inplace"], {}, (True, "")),
    (["bdist_wheel"], {"TIERKV_PURE_PYTHON": "1"}, (False, "TIERKV_PURE_PYTHON=1 at install")),
    (["bdist_wheel"], {"TIERKV_PURE_PYTHON": "0"}, (True, "")),
    (["editable_wheel", "--dist-info-dir", "/tmp/x"], {}, (False, "editable install without TIERKV_COMPILE=1")),
    (["editable_wheel", "--dist-info-dir", "/tmp/x"], {"TIERKV_COMPILE": "0"}, (False, compiled.EDITABLE_SKIPPED)),
    (["editable_wheel", "--dist-info-dir", "/tmp/x"], {"TIERKV_COMPILE": "1"}, (True, "")),
    (["develop"], {}, (False, compiled.EDITABLE_SKIPPED)),
    (["editable_wheel"], {"TIERKV_COMPILE": "1", "TIERKV_PURE_PYTHON": "1"}, (False, "TIERKV_PURE_PYTHON=1 at install")),
    (["egg_info"], {"TIERKV_COMPILE": "1"}, (False, "not a build command")),  # pip's metadata run
    (["dist_info", "--output-dir", "/tmp/x"], {}, (False, "not a build command")),
])
def test_wheels_compile_editable_installs_only_when_asked(argv, env, expected):
    assert tuple(compiled.plan(argv, env)) == expected


def test_an_editable_install_that_skips_the_compile_keeps_an_earlier_build():
    earlier = compiled.built({"tierkv.blocks": "00" * 32})
    skipped = compiled.plan(["editable_wheel"], {})
    assert compiled.keeps_earlier_build(earlier, skipped)
    assert not compiled.keeps_earlier_build(None, skipped)  # nothing built before: record the skip
    assert not compiled.keeps_earlier_build(compiled.not_built("CompileError: gcc", failed=True), skipped)
    # Plain Python asked for outright: the earlier build is turned off (native.py then
    # imports its modules from source).
    assert not compiled.keeps_earlier_build(earlier, compiled.plan(["editable_wheel"], {"TIERKV_PURE_PYTHON": "1"}))
    assert not compiled.keeps_earlier_build(earlier, compiled.plan(["bdist_wheel"], {"TIERKV_PURE_PYTHON": "1"}))


def _run_setup(monkeypatch, argv: list[str], env: dict[str, str], mypycify=None) -> dict:
    """setup.py's globals after a run with ``argv``, ``setup()`` itself replaced (nothing is
    built): what it would hand setuptools, and the manifest it would record."""
    import setuptools

    for name in ("TIERKV_COMPILE", "TIERKV_PURE_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    handed: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: handed.update(kw))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "setup.py"), *argv])
    if mypycify is not None:
        import mypyc.build

        monkeypatch.setattr(mypyc.build, "mypycify", mypycify)
    out = runpy.run_path(str(ROOT / "setup.py"))
    out["handed"] = handed
    return out


def test_setup_builds_what_the_plan_says_and_records_why_not(monkeypatch):
    pytest.importorskip("mypyc")
    asked: list[list[str]] = []

    def fake_mypycify(paths, **kw):
        asked.append(paths)
        return ["the extensions"]

    ran = _run_setup(monkeypatch, ["editable_wheel"], {}, fake_mypycify)
    assert ran["handed"]["ext_modules"] == [] and asked == []
    assert ran["NOT_BUILT"]["plain"] == compiled.EDITABLE_SKIPPED
    ran = _run_setup(monkeypatch, ["editable_wheel"], {"TIERKV_COMPILE": "1"}, fake_mypycify)
    assert ran["handed"]["ext_modules"] == ["the extensions"] and ran["NOT_BUILT"] is None
    assert [p for p in asked[0] if p.endswith(".py")] == [compiled.source(m) for m in compiled.MODULES]
    ran = _run_setup(monkeypatch, ["egg_info"], {}, fake_mypycify)
    assert ran["handed"]["ext_modules"] == [] and ran["NOT_BUILT"] is None  # nothing to record


def test_a_type_error_at_build_time_is_recorded_with_the_first_error(monkeypatch, capsys):
    pytest.importorskip("mypyc")

    def refusing(paths, **kw):
        print("tierkv/blocks.py:10: error: Incompatible types\ntierkv/holds.py:3: error: Name \"x\" is not defined")
        raise SystemExit(1)

    ran = _run_setup(monkeypatch, ["bdist_wheel"], {}, refusing)
    assert ran["handed"]["ext_modules"] == []
    assert ran["NOT_BUILT"]["failed"] == "mypyc: tierkv/blocks.py:10: error: Incompatible types (and 1 more)"
    captured = capsys.readouterr()
    assert "tierkv: WARNING: mypyc refused the metadata path" in captured.err
    assert "holds.py:3: error" in captured.out  # mypy's own report still printed


def test_the_compiled_list_lives_in_one_place():
    """setup.py, tierkv/native.py and the tests read tierkv/compiled.py; nothing repeats the list."""
    assert len(set(compiled.MODULES)) == len(compiled.MODULES)
    for name in compiled.MODULES:
        assert (ROOT / compiled.source(name)).is_file(), name
    for path in ("setup.py", "tierkv/native.py", "scripts/replay_ab.py"):
        text = (ROOT / path).read_text()
        assert '"tierkv.blocks"' not in text and "'tierkv.blocks'" not in text, f"{path} repeats the list"
    # setup.py loads the file by path, before tierkv (and torch) can be imported.
    assert "import tierkv" not in (ROOT / "setup.py").read_text()
    assert not [line for line in (ROOT / "tierkv" / "compiled.py").read_text().splitlines()
                if line.startswith(("import ", "from ")) and not line.startswith(
                    ("from __future__", "import sys", "from typing"))]


# ---- mypy --strict ------------------------------------------------------------------------
# The flags, each for a reason:
#   --strict                   every function typed, no implicit Any, no unused ignores.
#   --no-site-packages         as in the build environment, where torch and numpy are absent:
#                              their types are Any to mypyc, so they are Any here (and the
#                              check takes a second instead of analysing torch).
#   --ignore-missing-imports   what that makes of ``import torch``, as setup.py's mypycify.
#   --follow-imports=silent    the uncompiled tierkv modules they import are read for their
#                              types, not held to --strict (they are not compiled).
MYPY_FLAGS = ["--strict", "--no-site-packages", "--ignore-missing-imports", "--follow-imports=silent"]


def run_strict_mypy(files: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    return subprocess.run([mypy, *MYPY_FLAGS, "--cache-dir", str(cache), *files], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_the_compiled_modules_pass_mypy_strict(tmp_path):
    done = run_strict_mypy([compiled.source(m) for m in compiled.MODULES], ROOT, tmp_path / "cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout


def test_the_strict_check_fails_on_a_type_error(tmp_path):
    """The check above can fail: the same command on a copy of the package with one error."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "tierkv", copy / "tierkv", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = copy / compiled.source(compiled.MODULES[0])
    target.write_text(target.read_text() + "\n\ndef untyped(x):\n    return x\n")
    done = run_strict_mypy([compiled.source(m) for m in compiled.MODULES], copy, tmp_path / "cache")
    assert done.returncode == 1
    assert f"{compiled.source(compiled.MODULES[0])}:" in done.stdout and "no-untyped-def" in done.stdout
