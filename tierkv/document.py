"""A repository document: files and trees turned into one deterministic text.

Every file becomes a header line ``=== <path> ===`` followed by its text (a newline is
added when it does not end with one); :attr:`Document.sections` holds each file's part.
The order of the files is ``DocumentOptions.order``: ``"path"`` sorts them by header path;
``"history"`` puts files likely to change last (by last-commit time inside git, by mtime
outside; :mod:`tierkv.document_order`), so an edit invalidates less of a cached prefix.
Either way the same tree (and, for ``"history"`` in git, the same history) gives the same
document whatever order it was written in, on any machine. The path of a file found under
a directory argument ``repo`` is ``repo/<path inside repo>``; a file given directly
appears under its own name.

Skipped (listed in :attr:`Document.skipped`, never in the text): anything ignored by
.gitignore rules, ``.git`` directories and files, files larger than ``max_file_bytes``,
binary files (a NUL byte in the first 8 KiB, or not UTF-8), files not matching an
``include`` glob or matching an ``exclude`` glob, and unreadable files (those are also
reported through ``on_warning``).

Ignore rules are git's own, read by a library rather than a parser of ours (issue #35,
item 3). Inside a git work tree the files of a directory argument are what
``git ls-files --cached --others --exclude-standard`` lists: every .gitignore (those above
the argument too), ``.git/info/exclude`` and the global excludes file apply, and a
directory argument that git ignores yields nothing. Outside git (or when git fails), the
tree is walked and each directory's .gitignore is matched with ``pathspec``'s
``GitIgnoreSpec`` against paths relative to that directory, deeper files deciding last;
.gitignore files above the argument and the exclude files are not read there. As in git,
a file inside an ignored directory cannot be re-included, and an ignored directory is
listed once, by its own path, in ``skipped``.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from pathspec import GitIgnoreSpec

from .document_order import KeptFile, stability_order
from .errors import ConfigError, NotFoundError
from .git import run_git, split_z

DEFAULT_MAX_FILE_BYTES = 1 << 20
_SNIFF_BYTES = 8192
ORDERS = ("path", "history")


@dataclass(frozen=True)
class DocumentOptions:
    """What goes into a document. ``include``/``exclude`` are fnmatch globs matched
    against a file's header path (``*`` also matches ``/``): with includes, only files
    matching one are kept; a file matching an exclude is dropped. ``order``: ``"path"``
    (sorted by header path) or ``"history"`` (files likely to change last; see
    :mod:`tierkv.document_order`)."""

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
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")

    def to_dict(self) -> dict:
        return {"include": list(self.include), "exclude": list(self.exclude),
                "max_file_bytes": self.max_file_bytes, "gitignore": self.gitignore, "order": self.order}

    @classmethod
    def from_dict(cls, d: dict) -> "DocumentOptions":
        # A manifest written before `order` existed was built in path order: re-deriving
        # it must give the same document, so a missing order means "path".
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
    """``files`` and ``sections`` are parallel and in document order: ``sections[i]`` is
    the text ``files[i]`` contributes (its header line included), and ``text`` is their
    concatenation."""

    text: str
    files: tuple[SourceFile, ...]
    skipped: tuple[SkippedFile, ...] = field(default=())
    sections: tuple[str, ...] = field(default=())

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# --- which files -----------------------------------------------------------------------


def _git_listing(root: Path) -> Iterator[tuple[str, Path | None]] | None:
    """The files of directory ``root`` as git sees them, or None outside a git work tree.

    Kept files are git's tracked and untracked-but-not-ignored files under ``root``, so
    every ignore rule git honours applies. A tracked file deleted from the tree is left
    out; a nested repository (a submodule, a clone inside the tree) is listed by its own
    git. Ignored paths come back as (rel, None), an ignored directory once.
    """
    kept = run_git(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], root)
    ignored = run_git(["ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"], root)
    if kept is None or ignored is None:
        return None
    return _git_entries(root, split_z(kept), split_z(ignored))


def _git_entries(root: Path, kept: list[str], ignored: list[str]) -> Iterator[tuple[str, Path | None]]:
    for rel in dict.fromkeys(kept):  # an unmerged file is listed once per stage
        rel = rel.rstrip("/")
        file = root / rel
        if rel in ("", ".") or not os.path.lexists(file):
            continue  # "./": root is itself a submodule's path; or tracked but deleted
        if file.is_dir() and not file.is_symlink():
            # A nested repository is listed by its own git. Without a .git of its own (a
            # submodule not checked out) git run there would answer for the outer tree
            # again, so the (usually empty) directory is walked instead.
            nested = _git_listing(file) if (file / ".git").exists() else None
            for sub, f in nested if nested is not None else _walk(file, True):
                yield f"{rel}/{sub}", f
        else:
            yield rel, file
    for rel in ignored:
        yield rel.rstrip("/"), None


def _ignored(specs: Sequence[tuple[str, GitIgnoreSpec]], rel: str, is_dir: bool) -> bool:
    """Whether the .gitignore files ``specs`` (their directory, their patterns; outer
    first) ignore ``rel``: each matches paths relative to its directory, and the last
    file with a matching pattern decides, so deeper files override shallower ones."""
    ignored = False
    for base, spec in specs:
        if base and not rel.startswith(base + "/"):
            continue
        sub = rel[len(base) + 1 :] if base else rel
        decision = spec.check_file(sub + "/" if is_dir else sub).include
        if decision is not None:
            ignored = decision
    return ignored


def _walk(root: Path, use_gitignore: bool) -> Iterator[tuple[str, Path | None]]:
    """Yield (path relative to root, file path) for kept files and (rel, None) for files a
    .gitignore drops, reading the tree itself (outside git, or with .gitignore off)."""
    specs_at: dict[str, list[tuple[str, GitIgnoreSpec]]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        specs = list(specs_at.get(rel_dir.rsplit("/", 1)[0] if "/" in rel_dir else "", [])) if rel_dir else []
        gitignore = Path(dirpath) / ".gitignore"
        if use_gitignore and gitignore.is_file():
            try:
                lines = gitignore.read_text(encoding="utf-8", errors="replace").splitlines()
                specs.append((rel_dir, GitIgnoreSpec.from_lines(lines)))
            except OSError:
                pass  # an unreadable .gitignore is itself reported as an unreadable file below
        specs_at[rel_dir] = specs
        kept = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            # Pruned, as git does: a file inside an ignored directory cannot be re-included.
            if d == ".git":
                continue
            if _ignored(specs, rel, True):
                yield rel, None
            else:
                kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name == ".git":
                continue  # a worktree's or submodule's pointer to its git dir: a machine path
            rel = f"{rel_dir}/{name}" if rel_dir else name
            yield rel, (None if _ignored(specs, rel, False) else Path(dirpath) / name)


def _candidates(paths: Iterable[str | os.PathLike[str]], use_gitignore: bool) -> Iterator[tuple[str, Path | None]]:
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise NotFoundError(f"{p} does not exist", hint="pass existing files or directories")
        name = p.resolve().name
        if p.is_dir():
            listing = _git_listing(p) if use_gitignore else None
            for rel, file in listing if listing is not None else _walk(p, use_gitignore):
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
    kept = [KeptFile(rel, chosen[rel]) for rel in sorted(chosen)]
    if options.order == "history":
        kept = stability_order(kept, [Path(p) for p in paths])
    parts: list[str] = []
    files: list[SourceFile] = []
    for rel, path in kept:
        try:
            text, raw, reason = _read_text(path, options.max_file_bytes)
        except OSError as exc:
            reason = f"unreadable ({exc.strerror or exc})"
            if on_warning is not None:
                on_warning(f"skipping {path}: {reason}")
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
