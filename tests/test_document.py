"""tierkv.document: deterministic documents, .gitignore rules, skipped files, file order."""
from __future__ import annotations

import builtins
import errno
import os
import random
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from tierkv.document import DocumentOptions, build_document
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


def git(root: Path, *args: str, when: int = 1_000_000_000) -> None:
    """Run git in ``root`` with fixed identity and times (and no signing from the user's config)."""
    env = {**os.environ, "GIT_AUTHOR_DATE": f"@{when} +0000", "GIT_COMMITTER_DATE": f"@{when} +0000"}
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=t", "-c", "commit.gpgsign=false", *args],
                   cwd=root, env=env, check=True, capture_output=True)


def kept_paths(root: Path) -> set[str]:
    return {f.path.split("/", 1)[1] for f in build_document([root]).files}


@pytest.mark.parametrize("in_git", [False, True], ids=["pathspec", "git"])
def test_gitignore_patterns(tmp_path, in_git):
    """The cases the hand-written parser was specified by, now through a real tree: the
    same rules hold for pathspec outside git and for git itself."""
    trees = {
        "globs": {".gitignore": "a/**/b\nfoo/**\n[ab]?.c\n", "a/b": "x", "a/x/y/b": "x", "foo/x/y": "x",
                  "d/ax.c": "x", "cx.c": "x", "keep.txt": "x"},
        "file-named-foo": {".gitignore": "foo/**\n", "foo": "x"},
        "nested": {"docs/.gitignore": "*.md\n", "docs/x.md": "x", "x.md": "x"},
    }
    kept = {}
    for name, files in trees.items():
        root = write_tree(tmp_path / name, files)
        if in_git:
            git(root, "init", "-q")
        kept[name] = kept_paths(root)
    assert kept["globs"] == {".gitignore", "cx.c", "keep.txt"}
    assert kept["file-named-foo"] == {".gitignore", "foo"}
    assert kept["nested"] == {"docs/.gitignore", "x.md"}


GIT_TREE = {".gitignore": "*.log\n", "z_old.py": "old\n", "b.py": "b1\n", "mod.py": "m1\n"}
T0 = 1_000_000_000


def make_repo(root: Path) -> Path:
    """Three commits at fixed times, then a modified, a staged, an untracked, an ignored and
    an excluded file; checkout mtimes written newest-first to show they are not used."""
    write_tree(root, GIT_TREE)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "one", when=T0)
    write_tree(root, {"a_mid.py": "mid\n", "b.py": "b2\n"})
    git(root, "add", "-A")
    git(root, "commit", "-qm", "two", when=T0 + 100)
    write_tree(root, {"c_new.py": "new\n"})
    git(root, "add", "-A")
    git(root, "commit", "-qm", "three", when=T0 + 200)
    write_tree(root, {"mod.py": "m2\n", "staged.py": "s\n", "untracked.py": "u\n", "x.log": "log\n",
                      "secret.txt": "s\n", "sub/deleted.py": "d\n"})
    git(root, "add", "staged.py", "sub/deleted.py")
    git(root, "commit", "-qm", "four", "--", "sub/deleted.py", when=T0 + 300)
    (root / "sub" / "deleted.py").unlink()  # tracked, gone from the tree: left out, no error
    (root / ".git" / "info" / "exclude").write_text("secret.txt\n")
    for i, rel in enumerate(["z_old.py", ".gitignore", "b.py", "a_mid.py", "c_new.py"]):
        os.utime(root / rel, ns=(T0 * 10**9, (T0 + 1000 - i) * 10**9))
    return root


COMMITTED_ORDER = [".gitignore", "z_old.py", "a_mid.py", "b.py", "c_new.py"]


def test_history_order_in_a_git_work_tree(tmp_path):
    root = make_repo(tmp_path / "repo")
    doc = build_document([root], DocumentOptions(order="history"))
    assert [f.path for f in doc.files] == [f"repo/{p}" for p in
                                           COMMITTED_ORDER + ["mod.py", "staged.py", "untracked.py"]]
    assert doc.text == "".join(doc.sections) and len(doc.sections) == len(doc.files)
    for f, section in zip(doc.files, doc.sections):
        assert section.startswith(f"=== {f.path} ===\n")
    ignored = {s.path for s in doc.skipped if s.reason == "ignored by .gitignore"}
    assert ignored == {"repo/x.log", "repo/secret.txt"}
    by_path = build_document([root])
    assert [f.path for f in by_path.files] == sorted(f.path for f in doc.files)
    assert sorted(by_path.sections) == sorted(doc.sections)
    # Another checkout (other mtimes, without the local changes) orders by the same history.
    clone = tmp_path / "other" / "repo"
    git(tmp_path, "clone", "-q", str(root), str(clone))
    assert [f.path for f in build_document([clone], DocumentOptions(order="history")).files] == \
        [f"repo/{p}" for p in [".gitignore", "mod.py", "z_old.py", "a_mid.py", "b.py", "c_new.py", "sub/deleted.py"]]


def test_a_file_added_by_a_merge_commit_is_dated_by_the_merge(tmp_path):
    """git log shows no files for a merge by default: a file created in the merge commit
    itself was ordered as untracked."""
    root = write_tree(tmp_path / "repo", {"base.py": "b\n"})
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base", when=T0)
    git(root, "checkout", "-qb", "side")
    write_tree(root, {"s.py": "s\n"})
    git(root, "add", "-A")
    git(root, "commit", "-qm", "side", when=T0 + 100)
    git(root, "checkout", "-q", "-")
    write_tree(root, {"m.py": "m\n"})
    git(root, "add", "-A")
    git(root, "commit", "-qm", "main", when=T0 + 200)
    git(root, "merge", "-q", "--no-ff", "--no-commit", "side", when=T0 + 300)
    write_tree(root, {"e.py": "e\n"})
    git(root, "add", "e.py")
    git(root, "commit", "-qm", "merge", when=T0 + 300)
    write_tree(root, {"a_untracked.py": "u\n"})
    doc = build_document([root], DocumentOptions(order="history"))
    assert [f.path for f in doc.files] == [f"repo/{p}" for p in ["base.py", "s.py", "m.py", "e.py", "a_untracked.py"]]


def test_a_submodule_not_checked_out_does_not_recurse_forever(tmp_path):
    """git ls-files run inside a gitlink's empty directory lists "./" (the outer tree's
    entry for it): listing that again recursed without end."""
    root = write_tree(tmp_path / "repo", {"o.py": "o\n", "nested/n.py": "n\n", "nested/.gitignore": "*.tmp\n",
                                          "nested/x.tmp": "x\n"})
    git(root / "nested", "init", "-q")  # a clone inside the tree: listed by its own git
    git(root, "init", "-q")
    (root / "sub").mkdir()
    git(root, "update-index", "--add", "--cacheinfo", f"160000,{'1' * 40},sub")
    doc = build_document([root], DocumentOptions(order="history"))
    assert sorted(f.path for f in doc.files) == ["repo/nested/.gitignore", "repo/nested/n.py", "repo/o.py"]
    assert [s.path for s in doc.skipped] == ["repo/nested/x.tmp"]


def test_history_order_outside_git_is_by_mtime_then_path(tmp_path):
    root = write_tree(tmp_path / "plain", {"a.py": "a\n", "b.py": "b\n", "c.py": "c\n", "d.py": "d\n"})
    for rel, t in {"a.py": 30, "b.py": 10, "c.py": 20, "d.py": 10}.items():
        os.utime(root / rel, ns=(0, (T0 + t) * 10**9))
    doc = build_document([root], DocumentOptions(order="history"))
    assert [f.path for f in doc.files] == ["plain/b.py", "plain/d.py", "plain/c.py", "plain/a.py"]


def test_roots_in_and_out_of_git_merge_into_one_order(tmp_path):
    repo = make_repo(tmp_path / "repo")
    plain = write_tree(tmp_path / "plain", {"p.py": "p\n"})
    os.utime(plain / "p.py", ns=(0, (T0 + 150) * 10**9))  # between commits two and three
    doc = build_document([repo, plain], DocumentOptions(order="history"))
    assert [f.path for f in doc.files][3:6] == ["repo/b.py", "plain/p.py", "repo/c_new.py"]
    assert [f.path for f in doc.files][-1] == "repo/untracked.py"


def test_history_order_falls_back_to_mtime_without_git(tmp_path):
    """No git binary (or a shallow clone): the mtime order, no exception."""
    root = make_repo(tmp_path / "repo")
    with mock.patch("tierkv.git.subprocess.run", side_effect=FileNotFoundError("git")):
        doc = build_document([root], DocumentOptions(order="history"))
    times = [os.stat(root / f.path.split("/", 1)[1]).st_mtime_ns for f in doc.files]
    assert times == sorted(times)
    shallow = tmp_path / "shallow" / "repo"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{root}", str(shallow))
    files = sorted(p.relative_to(shallow).as_posix() for p in shallow.rglob("*")
                   if p.is_file() and ".git" not in p.parts)
    for i, rel in enumerate(files):
        os.utime(shallow / rel, ns=(0, (T0 - i) * 10**9))  # reverse path order
    doc = build_document([shallow], DocumentOptions(order="history"))
    assert [f.path for f in doc.files] == sorted((f.path for f in doc.files), reverse=True)


def test_order_option():
    assert DocumentOptions().order == "path"
    with pytest.raises(ValueError, match="path, history"):
        DocumentOptions(order="mtime")
    opts = DocumentOptions(order="history")
    assert DocumentOptions.from_dict(opts.to_dict()) == opts
    old_manifest = {"include": [], "exclude": [], "max_file_bytes": 10, "gitignore": True}
    assert DocumentOptions.from_dict(old_manifest).order == "path"


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
