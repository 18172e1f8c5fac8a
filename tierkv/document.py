"""A repository document: files and trees turned into one deterministic text.

Every file becomes a header line ``=== <path> ===`` followed by its text (a newline is
added when it does not end with one). Files are sorted by that path, so the same tree
gives the same document whatever order it was written in, on any machine. The path of a
file found under a directory argument ``repo`` is ``repo/<path inside repo>``; a file given
directly appears under its own name.

Skipped (listed in :attr:`Document.skipped`, never in the text): anything ignored by a
``.gitignore`` at or below a directory argument, ``.git`` directories, files larger than
``max_file_bytes``, binary files (a NUL byte in the first 8 KiB, or not UTF-8), files not
matching an ``include`` glob or matching an ``exclude`` glob, and unreadable files (those
are also reported through ``on_warning``).

The .gitignore subset understood here: blank lines and ``#`` comments; ``!`` re-includes;
a leading ``\\`` escapes ``#`` or ``!``; a trailing ``/`` matches directories only; a
pattern with a ``/`` elsewhere is anchored to its .gitignore's directory, otherwise it
matches a name at any depth; ``*``, ``?``, ``[...]`` and ``**`` (``**/x``, ``x/**``,
``a/**/b``). The last matching pattern wins and deeper .gitignore files come later. Not
read: ``.gitignore`` files above the argument, ``.git/info/exclude``, the global excludes
file. As in git, a file inside an ignored directory cannot be re-included.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from .errors import ConfigError, NotFoundError

DEFAULT_MAX_FILE_BYTES = 1 << 20
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class DocumentOptions:
    """What goes into a document. ``include``/``exclude`` are fnmatch globs matched
    against a file's header path (``*`` also matches ``/``): with includes, only files
    matching one are kept; a file matching an exclude is dropped."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    gitignore: bool = True
    order: str = "path"

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.max_file_bytes <= 0:
            raise ValueError(f"max_file_bytes must be positive, got {self.max_file_bytes}")

    def to_dict(self) -> dict:
        return {"include": list(self.include), "exclude": list(self.exclude),
                "max_file_bytes": self.max_file_bytes, "gitignore": self.gitignore, "order": self.order}

    @classmethod
    def from_dict(cls, d: dict) -> "DocumentOptions":
        return cls(tuple(d.get("include", ())), tuple(d.get("exclude", ())),
                   int(d.get("max_file_bytes", DEFAULT_MAX_FILE_BYTES)), bool(d.get("gitignore", True)),
                   str(d.get("order", "path")))


@dataclass(frozen=True)
class SourceFile:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass(frozen=True)
class Document:
    text: str
    files: tuple[SourceFile, ...]
    skipped: tuple[SkippedFile, ...] = field(default=())
    sections: tuple[str, ...] = field(default=())

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# --- .gitignore -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    base: str  # directory of the .gitignore, relative to the walk root ("" for the root)
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    anchored: bool

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1 :]
        target = rel if self.anchored else rel.rsplit("/", 1)[-1]
        return self.regex.fullmatch(target) is not None


def _glob_to_regex(pat: str) -> str:
    out, i = [], 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pat.startswith("**", i):
            out.append(".*")
            i += 2
        elif pat[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pat[i] == "?":
            out.append("[^/]")
            i += 1
        elif pat[i] == "[" and (end := pat.find("]", i + 2)) != -1:
            body = pat[i + 1 : end]
            body = "^" + body[1:] if body[0] in "!^" else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pat[i]))
            i += 1
    return "".join(out)


def parse_gitignore(text: str, base: str = "") -> list[_Rule]:
    """Rules of one .gitignore whose directory is ``base`` (relative to the walk root)."""
    rules = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        if line.startswith("\\"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        rules.append(_Rule(base, re.compile(_glob_to_regex(line)), negate, dir_only, anchored))
    return rules


def is_ignored(rules: Sequence[_Rule], rel: str, is_dir: bool) -> bool:
    ignored = False
    for rule in rules:
        if rule.matches(rel, is_dir):
            ignored = not rule.negate
    return ignored


# --- walking --------------------------------------------------------------------------


def _walk(root: Path, use_gitignore: bool) -> Iterator[tuple[str, Path | None]]:
    """Yield (path relative to root, file path) for kept files and (rel, None) for files a
    .gitignore drops."""
    rules_at: dict[str, list[_Rule]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        rules = list(rules_at.get(rel_dir.rsplit("/", 1)[0] if "/" in rel_dir else "", [])) if rel_dir else []
        gitignore = Path(dirpath) / ".gitignore"
        if use_gitignore and gitignore.is_file():
            try:
                rules += parse_gitignore(gitignore.read_text(encoding="utf-8", errors="replace"), rel_dir)
            except OSError:
                pass  # an unreadable .gitignore is itself reported as an unreadable file below
        rules_at[rel_dir] = rules
        kept = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if d != ".git" and not is_ignored(rules, rel, True):
                kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            yield rel, (None if is_ignored(rules, rel, False) else Path(dirpath) / name)


def _candidates(paths: Iterable[str | os.PathLike[str]], use_gitignore: bool) -> Iterator[tuple[str, Path | None]]:
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise NotFoundError(f"{p} does not exist", hint="pass existing files or directories")
        name = p.resolve().name
        if p.is_dir():
            for rel, file in _walk(p, use_gitignore):
                yield f"{name}/{rel}", file
        else:
            yield name, p


def _read_text(path: Path, size_limit: int) -> tuple[str | None, bytes, str]:
    """(text, raw bytes, reason it was skipped); raises OSError when unreadable."""
    if path.stat().st_size > size_limit:
        return None, b"", f"larger than {size_limit} bytes"
    with open(path, "rb") as f:
        raw = f.read(size_limit + 1)
    if len(raw) > size_limit:
        return None, b"", f"larger than {size_limit} bytes"
    if b"\0" in raw[:_SNIFF_BYTES]:
        return None, raw, "binary"
    try:
        return raw.decode("utf-8"), raw, ""
    except UnicodeDecodeError:
        return None, raw, "binary (not UTF-8)"


def build_document(
    paths: Sequence[str | os.PathLike[str]],
    options: DocumentOptions = DocumentOptions(),
    *,
    on_warning: Callable[[str], None] | None = None,
) -> Document:
    """Build the document of ``paths`` (files and directories).

    Raises NotFoundError when a path does not exist or nothing is left to include, and
    ConfigError when two different inputs would appear under the same header path.
    Unreadable files are skipped and reported through ``on_warning``.
    """
    if not paths:
        raise NotFoundError("no paths to build a document from", hint="pass files or directories")
    chosen: dict[str, Path] = {}
    skipped: list[SkippedFile] = []
    for rel, file in _candidates(paths, options.gitignore):
        if file is None:
            skipped.append(SkippedFile(rel, "ignored by .gitignore"))
        elif options.include and not any(fnmatch.fnmatchcase(rel, g) for g in options.include):
            skipped.append(SkippedFile(rel, "not matched by --include"))
        elif any(fnmatch.fnmatchcase(rel, g) for g in options.exclude):
            skipped.append(SkippedFile(rel, "matched by --exclude"))
        elif rel in chosen and chosen[rel].resolve() != file.resolve():
            raise ConfigError(f"{chosen[rel]} and {file} would both appear as {rel}", hint="pass inputs with distinct names")
        else:
            chosen[rel] = file
    parts: list[str] = []
    files: list[SourceFile] = []
    names = sorted(chosen)
    if options.order == "history":
        names.sort(key=lambda r: chosen[r].stat().st_mtime_ns)
    for rel in names:
        try:
            text, raw, reason = _read_text(chosen[rel], options.max_file_bytes)
        except OSError as exc:
            reason = f"unreadable ({exc.strerror or exc})"
            if on_warning is not None:
                on_warning(f"skipping {chosen[rel]}: {reason}")
            skipped.append(SkippedFile(rel, reason))
            continue
        if text is None:
            skipped.append(SkippedFile(rel, reason))
            continue
        parts.append(f"=== {rel} ===\n{text}" + ("" if text.endswith("\n") else "\n"))
        files.append(SourceFile(rel, hashlib.sha256(raw).hexdigest(), len(raw)))
    if not files:
        raise NotFoundError(
            f"no text files to include under {', '.join(map(str, paths))}",
            hint="check the paths, --include/--exclude, --max-file-bytes and .gitignore",
        )
    return Document("".join(parts), tuple(files), tuple(sorted(skipped, key=lambda s: s.path)), tuple(parts))
