"""The top-level kernels/ directory must not shadow the Hugging Face ``kernels`` package
(which transformers and vLLM import) when Python runs from the repository root, and
``tierkv.kernels`` must keep its API (issue 10, item 5); every runtime dependency is used and
documented (issue 37, item 10)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_at_root(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_kernels_dir_is_not_a_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    # At most a PEP 420 namespace portion (no loader, no __file__), which transformers
    # treats as "not installed".
    got = run_at_root("import importlib.util as u; s = u.find_spec('kernels'); print(s is None or s.loader is None)")
    assert got == "True"


def test_an_installed_kernels_package_wins_over_the_repository_directory(tmp_path):
    site = tmp_path / "site" / "kernels"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("REAL = True\n")
    got = run_at_root(f"import sys; sys.path.append({str(site.parent)!r}); import kernels; print(kernels.REAL)")
    assert got == "True"


def test_tierkv_kernels_api_from_the_repository_root():
    got = run_at_root("import tierkv.kernels as k, tierkv.kernels.reference as r; "
                      "print(callable(k.paged_decode_attention) and callable(r.paged_decode_reference))")
    assert got == "True"


def test_transformers_sees_no_kernels_package_from_the_repository_root():
    got = run_at_root("from transformers.utils.import_utils import is_kernels_available; "
                      "print(is_kernels_available())")
    assert got == "False"


# Runtime dependencies tierkv does not import itself, each with its reason.
NOT_IMPORTED = {
    "safetensors": "the disk segments are safetensors files (docs/dependencies.md); transformers loads weights with it",
}
MODULE_OF = {"prometheus-client": "prometheus_client"}


def test_every_runtime_dependency_is_imported_and_documented():
    """Issue #37, item 10: aiofiles was a dependency nothing imported."""
    import re
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] for d in pyproject["project"]["dependencies"]]
    sources = "\n".join(p.read_text() for d in ("tierkv", "kernels") for p in (ROOT / d).rglob("*.py"))
    documented = (ROOT / "docs" / "dependencies.md").read_text()
    assert "aiofiles" not in names
    for name in names:
        module = MODULE_OF.get(name, name)
        imported = re.search(rf"^\s*(import|from) {re.escape(module)}\b", sources, flags=re.M)
        assert imported or name in NOT_IMPORTED, f"{name} is a dependency nothing in tierkv imports"
        assert re.search(rf"^\| [^|]*\b{re.escape(name)}\b", documented, flags=re.M), \
            f"{name} is not in docs/dependencies.md's table"


def test_the_wheel_holds_every_module_of_the_source_tree(tmp_path):
    # tierkv.home was once missing from wheels (a hand-kept package list) while every
    # editable-install test passed. Plain Python (no mypyc) keeps the build to seconds.
    # Built from a copy: setuptools keeps build/lib between builds, so a stale file there
    # would hide a module the configuration leaves out.
    import os
    import shutil
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.so", "__pycache__",
                                                             "*.egg-info", "dist"))
    env = dict(os.environ, TIERKV_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    [wheel] = tmp_path.glob("tierkv-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tierkv").rglob("*.py")}
    assert source <= shipped, f"left out of the wheel: {sorted(source - shipped)}"
    kernels = {f"tierkv/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    assert kernels <= shipped, f"kernels not copied into the wheel: {sorted(kernels - shipped)}"
