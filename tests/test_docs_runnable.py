"""Every shell block the docs mark runnable runs (issue #37: docs a newcomer reads). A block
is marked by an HTML comment starting `<!-- runnable` on the line before its fence; its
placeholders are filled with test fixtures (path/to/model: a tiny model directory;
path/to/repo: a small repository; path/to/home: a fresh home), `tierkv` is this
interpreter's, and each command line must exit 0."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKED = re.compile(r"^<!-- runnable[^\n]*-->\n```bash\n(.*?)^```", re.S | re.M)


def runnable_blocks() -> list[tuple[str, str]]:
    out = []
    for md in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        for m in MARKED.finditer(md.read_text()):
            out.append((str(md.relative_to(ROOT)), m.group(1)))
    return out


def commands(block: str) -> list[str]:
    """The block's command lines (comments and blank lines dropped; `\\` continuations joined)."""
    lines = block.replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_docs_mark_blocks_runnable():
    assert {doc for doc, _ in runnable_blocks()} >= {"docs/quickstart.md", "docs/operations.md"}


@pytest.mark.parametrize("doc,block", runnable_blocks(), ids=lambda v: v if v.endswith(".md") else "")
def test_a_runnable_block_runs(doc, block, llama_dir, repo, tmp_path, private_caches):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    env["TIERKV_HOME"] = str(tmp_path / "home")
    fill = {"path/to/model": str(llama_dir), "path/to/repo": str(repo), "path/to/home": str(tmp_path / "home")}
    for line in commands(block):
        for placeholder, value in fill.items():
            line = line.replace(placeholder, shlex.quote(value))
        words = shlex.split(line)
        assigns = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        assert words[0] in ("tierkv", ".venv/bin/tierkv"), f"{doc}: not a tierkv command: {line}"
        r = subprocess.run([sys.executable, "-m", "tierkv", *words[1:]], env={**env, **assigns}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{doc}: `{line}` exited {r.returncode}:\n{r.stderr[-2000:]}"
