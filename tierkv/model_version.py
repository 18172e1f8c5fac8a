"""Model version: a content fingerprint of what makes KV bytes what they are.

    model_version = SHA-256(enc("tierkv/model/v1"),
                            field("weights", digest of every weight file, or the user's version string),
                            field("config", digest of config.json / generation_config.json),
                            field("tokenizer", digest of the tokenizer files),
                            field("layout", canonical JSON of the page layout: dtype, layers, heads, block size))

Weight files are hashed streaming, 8 MiB at a time, and the digest is remembered in a small
JSON memo keyed by (real path, size, mtime_ns, inode), so a 100 GB checkpoint is hashed once
per machine; any change of the file changes one of those and forces a re-hash.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Iterable

from .errors import NotFoundError
from .identity import enc_field, enc_str
from .layout import PageLayout

MODEL_DOMAIN = "tierkv/model/v1"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
_CHUNK = 8 << 20
_memo_lock = threading.Lock()


def default_memo_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierkv" / "fingerprints.json"


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _load_memo(memo_path: Path | None) -> dict[str, str]:
    if memo_path is None or not memo_path.exists():
        return {}
    try:
        data = json.loads(memo_path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a damaged memo only costs a re-hash


def _save_memo(memo_path: Path | None, memo: dict[str, str]) -> None:
    if memo_path is None:
        return
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        # Write a temp file and rename so concurrent processes never read half a memo.
        fd, tmp = tempfile.mkstemp(dir=memo_path.parent, prefix=".fingerprints.")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, memo_path)
    except OSError:
        pass  # the memo is an optimisation; failing to write it is not an error


def file_digest(path: Path, memo_path: Path | None = None) -> str:
    """SHA-256 of one file's content, remembered by (path, size, mtime, inode)."""
    ident = _file_identity(path)
    with _memo_lock:
        memo = _load_memo(memo_path)
        if ident in memo:
            return memo[ident]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    with _memo_lock:
        memo = _load_memo(memo_path)
        memo[ident] = digest
        _save_memo(memo_path, memo)
    return digest


def _digest_files(root: Path, names: Iterable[str], memo_path: Path | None) -> list[str]:
    # Each entry names the file relative to the model directory, so renaming shards changes
    # the version but moving the whole directory does not.
    return [f"{name}:{file_digest(root / name, memo_path)}" for name in sorted(names) if (root / name).is_file()]


def weight_files(model_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(model_dir))
        for p in model_dir.rglob("*")
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) and "optimizer" not in p.name
    )


def model_version(
    model_dir: str | os.PathLike[str],
    layout: PageLayout,
    *,
    version: str | None = None,
    memo_path: Path | None = None,
) -> str:
    """Hex model-version hash of ``model_dir`` for KV in ``layout``.

    ``version`` replaces the weights part for users who version checkpoints themselves
    (config, tokenizer and layout are still hashed). Raises NotFoundError when the
    directory has no config.json or, without ``version``, no weight files.
    """
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise NotFoundError(f"{root} is not a model directory (no config.json)", hint="pass a Hugging Face model directory")
    if version is not None:
        weights: list[str] | str = f"explicit:{version}"
    else:
        weights = _digest_files(root, weight_files(root), memo_path)
        if not weights:
            raise NotFoundError(f"no weight files in {root}", hint=f"expected files ending in {WEIGHT_SUFFIXES}")
    return model_version_from_parts(
        weights=weights,
        config=_digest_files(root, CONFIG_FILES, memo_path),
        tokenizer=_digest_files(root, TOKENIZER_FILES, memo_path),
        layout=layout,
    )


def model_version_from_parts(
    *, weights: list[str] | str, config: list[str], tokenizer: list[str], layout: PageLayout
) -> str:
    """Combine already-digested parts (used for in-memory models too)."""
    return hashlib.sha256(
        enc_str(MODEL_DOMAIN)
        + enc_field("weights", weights if isinstance(weights, list) else [weights])
        + enc_field("config", config)
        + enc_field("tokenizer", tokenizer)
        + enc_field("layout", layout.to_json())
    ).hexdigest()
