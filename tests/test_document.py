"""tierkv.document: deterministic documents, .gitignore subset, skipped files."""
from __future__ import annotations

import builtins
import errno
import random
from pathlib import Path
from unittest import mock

import pytest

from tierkv.document import DocumentOptions, build_document, is_ignored, parse_gitignore
from tierkv.errors import ConfigError, NotFoundError

TREE = {
    "README.md": "# demo\n",
    "src/a.py": "print('a')\n",
    "src/b.py": "print('b')",  # no trailing newline
    "src/pkg/__init__.py": "",
    "src/pkg/mod.py": "x = 1\n",
    "docs/guide.md": "guide\n",
    "z.txt": "zzz\n",
}


def write_tree(root: Path, files: dict[str, str | bytes], seed: int | None = None) -> Path:
    items = list(files.items())
    if seed is not None:
        random.Random(seed).shuffle(items)
    for rel, content in items:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def test_same_tree_written_in_any_order_gives_the_same_document(tmp_path):
    docs = [build_document([write_tree(tmp_path / str(seed) / "repo", TREE, seed)]) for seed in range(3)]
    assert len({d.text for d in docs}) == 1
    assert [f.path for f in docs[0].files] == sorted(f"repo/{p}" for p in TREE)
    assert docs[0].sha256 == docs[1].sha256


def test_headers_and_text(tmp_path):
    doc = build_document([write_tree(tmp_path / "repo", {"b.py": "B", "a.py": "A\n"})])
    assert doc.text == "=== repo/a.py ===\nA\n=== repo/b.py ===\nB\n"
    single = build_document([tmp_path / "repo" / "b.py"])
    assert single.text == "=== b.py ===\nB\n" and single.files[0].size == 1


def test_gitignore_subset(tmp_path):
    files = {
        ".gitignore": "# comment\n*.log\nbuild/\n/top.txt\n!keep.log\ndocs/**/*.tmp\n\\#hash.txt\n",
        "a.log": "x", "keep.log": "x", "sub/b.log": "x", "top.txt": "x", "sub/top.txt": "x",
        "build/out.py": "x", "sub/build/out.py": "x", "docs/x/y/z.tmp": "x", "docs/z.tmp": "x",
        "#hash.txt": "x", "sub/.gitignore": "*.py\n!keep.py\n", "sub/c.py": "x", "sub/keep.py": "x",
        "c.py": "x", ".git/config": "x",
    }
    doc = build_document([write_tree(tmp_path / "r", files)])
    kept = {f.path.removeprefix("r/") for f in doc.files}
    assert kept == {".gitignore", "keep.log", "sub/top.txt", "sub/.gitignore", "sub/keep.py", "c.py"}
    ignored = {s.path.removeprefix("r/") for s in doc.skipped if s.reason == "ignored by .gitignore"}
    assert {"a.log", "sub/b.log", "top.txt", "docs/x/y/z.tmp", "docs/z.tmp", "#hash.txt", "sub/c.py"} <= ignored
    everything = build_document([tmp_path / "r"], DocumentOptions(gitignore=False))
    assert "r/a.log" in {f.path for f in everything.files}
    assert not any(f.path.startswith("r/.git/") for f in everything.files)


def test_gitignore_patterns():
    rules = parse_gitignore("a/**/b\nfoo/**\n[ab]?.c\n", base="")
    assert is_ignored(rules, "a/b", False) and is_ignored(rules, "a/x/y/b", False)
    assert is_ignored(rules, "foo/x/y", False) and not is_ignored(rules, "foo", False)
    assert is_ignored(rules, "d/ax.c", False) and not is_ignored(rules, "cx.c", False)
    nested = parse_gitignore("*.md\n", base="docs")
    assert is_ignored(nested, "docs/x.md", False) and not is_ignored(nested, "x.md", False)


def test_binary_large_include_exclude(tmp_path):
    files = {"a.py": "a\n", "b.md": "b\n", "bin.dat": b"\x00\x01\x02", "latin.txt": b"caf\xe9",
             "big.py": "x" * 100, "tests/t.py": "t\n"}
    root = write_tree(tmp_path / "r", files)
    doc = build_document([root], DocumentOptions(include=("*.py", "*.dat", "*.txt"), exclude=("*/tests/*",),
                                                 max_file_bytes=50))
    assert [f.path for f in doc.files] == ["r/a.py"]
    reasons = {s.path: s.reason for s in doc.skipped}
    assert reasons["r/bin.dat"] == "binary" and reasons["r/latin.txt"].startswith("binary")
    assert reasons["r/big.py"] == "larger than 50 bytes"
    assert reasons["r/b.md"] == "not matched by --include" and reasons["r/tests/t.py"] == "matched by --exclude"


def test_unreadable_file_is_skipped_with_a_warning(tmp_path):
    root = write_tree(tmp_path / "r", {"ok.py": "ok\n", "secret.py": "s\n"})
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if str(path).endswith("secret.py"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    warnings: list[str] = []
    with mock.patch("builtins.open", fake_open):
        doc = build_document([root], on_warning=warnings.append)
    assert [f.path for f in doc.files] == ["r/ok.py"]
    assert len(warnings) == 1 and "secret.py" in warnings[0] and "Permission denied" in warnings[0]


def test_empty_or_missing_inputs_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="no text files"):
        build_document([tmp_path / "empty"])
    with pytest.raises(NotFoundError, match="does not exist"):
        build_document([tmp_path / "missing"])
    a = write_tree(tmp_path / "a" / "same", {"x.py": "1\n"})
    b = write_tree(tmp_path / "b" / "same", {"x.py": "2\n"})
    with pytest.raises(ConfigError, match="same/x.py"):
        build_document([a, b])
