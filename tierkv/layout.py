"""One page format for every tier.

A *page* is the KV of one block of ``block_size`` tokens for all layers, as one contiguous
tensor ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` in the model's KV dtype
(index 0 of dim 1 is K, 1 is V). The same bytes live in the device pool, the host pool
and the disk segments, so moving a block between tiers is one contiguous copy and a
GPUDirect read lands straight in its slot.

transformers keeps KV per layer as ``[batch, num_kv_heads, seq, head_dim]``;
:func:`pack_pages` and :func:`unpack_pages` convert at that edge.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from .errors import PageFormatError

# Slots in host memory and on disk are padded to this many bytes so that O_DIRECT and
# GPUDirect reads (which need 4 KiB alignment of offset, size and buffer) can target them.
ALIGN = 4096

# Dtypes a model computes KV in (transformers runs in these; `--dtype` choices).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Dtypes an engine may *keep* KV in without computing in them: vLLM's fp8 KV caches
# (``kv_cache_dtype`` fp8/fp8_e4m3 and fp8_e5m2). Pages hold the engine's raw fp8 bytes; the
# scales the engine quantised with are part of the model version (integrations/vllm_config).
# Names are torch's, and they are stored in homes and model versions: never rename them.
FP8_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
PAGE_DTYPES: dict[str, torch.dtype] = {**DTYPES, **FP8_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in PAGE_DTYPES.items():
        if value == dtype:
            return name
    raise PageFormatError(f"unsupported KV dtype {dtype}", hint=f"use one of {sorted(PAGE_DTYPES)}")


# PageLayout's fields as a message names them (PageLayout.differences).
_FIELD_LABELS = (("block_size", "block size"), ("dtype", "dtype"), ("num_layers", "layers"),
                 ("num_kv_heads", "KV heads"), ("head_dim", "head dim"))


def layout_fix(wanted: PageLayout, held: PageLayout, whose: str) -> str:
    """A hint for a request of layout ``wanted`` where ``held`` (``whose``: "the prefix",
    "the home") is: the model options that would match it, or another model."""
    if (wanted.num_layers, wanted.num_kv_heads, wanted.head_dim) != (held.num_layers, held.num_kv_heads, held.head_dim):
        return f"{whose} was made by a model of other shapes: pass that model's directory"
    flags = [f"--block-size {held.block_size}"] if wanted.block_size != held.block_size else []
    flags += [f"--dtype {held.dtype}"] if wanted.dtype != held.dtype else []
    return f"pass {' '.join(flags)} (what {whose} holds)"


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class PageLayout:
    """Shape and dtype of one page; fixed per store home."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PageLayout.{field} must be a positive int, got {value!r}")
        if self.dtype not in PAGE_DTYPES:
            raise ValueError(f"PageLayout.dtype must be one of {sorted(PAGE_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return PAGE_DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def page_bytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes one page occupies in an aligned pool (host memory, disk segments)."""
        return round_up(self.page_bytes)

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "PageLayout":
        return cls(
            num_layers=int(d["num_layers"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            block_size=int(d["block_size"]),
            dtype=str(d["dtype"]),
        )

    def differences(self, other: "PageLayout") -> list[str]:
        """What differs from ``other``, in words, this layout's value first: ``["block size
        32 (not 16)"]``. Empty when equal. For messages that must name the field a user got
        wrong (issue #37, item 2: a block size mistaken for another model)."""
        return [f"{label} {getattr(self, f)} (not {getattr(other, f)})" for f, label in _FIELD_LABELS
                if getattr(self, f) != getattr(other, f)]

    def check_pages(self, pages: torch.Tensor, n_blocks: int | None = None) -> None:
        """Raise PageFormatError unless ``pages`` is ``[n, *shape]`` in this layout's dtype."""
        if not isinstance(pages, torch.Tensor):
            raise PageFormatError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
        if pages.dtype != self.torch_dtype:
            raise PageFormatError(f"pages have dtype {pages.dtype}, the store holds {self.dtype}")
        if pages.dim() != 6 or tuple(pages.shape[1:]) != self.shape:
            raise PageFormatError(
                f"pages have shape {tuple(pages.shape)}, expected [n, {', '.join(map(str, self.shape))}]"
            )
        if n_blocks is not None and pages.shape[0] != n_blocks:
            raise PageFormatError(f"got {pages.shape[0]} pages for {n_blocks} blocks")


def pack_pages(
    layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: PageLayout,
    start_token: int,
    n_blocks: int,
    batch_index: int = 0,
) -> torch.Tensor:
    """Cut ``n_blocks`` pages out of per-layer ``(K, V)`` tensors in transformers' layout.

    ``layer_kv[l]`` holds K and V of layer ``l`` as ``[batch, kv_heads, seq, head_dim]``;
    tokens ``[start_token, start_token + n_blocks * block_size)`` become pages
    ``[n_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` (a new contiguous tensor).
    """
    if len(layer_kv) != layout.num_layers:
        raise PageFormatError(f"got KV for {len(layer_kv)} layers, layout has {layout.num_layers}")
    bs = layout.block_size
    end = start_token + n_blocks * bs
    per_layer = []
    for k, v in layer_kv:
        if k.shape[1] != layout.num_kv_heads or k.shape[3] != layout.head_dim or k.shape[2] < end:
            raise PageFormatError(
                f"layer KV of shape {tuple(k.shape)} does not match layout {layout.shape} "
                f"for tokens [{start_token}, {end})"
            )
        kv = torch.stack((k[batch_index, :, start_token:end], v[batch_index, :, start_token:end]))
        # [2, H, n*B, D] -> [2, H, n, B, D] -> [n, 2, B, H, D]
        kv = kv.reshape(2, layout.num_kv_heads, n_blocks, bs, layout.head_dim).permute(2, 0, 3, 1, 4)
        per_layer.append(kv)
    pages = torch.stack(per_layer, dim=1).to(layout.torch_dtype).contiguous()
    return pages


# numpy moves bytes of any dtype through an integer view of the same width (it has no
# bfloat16); a permuted copy is only byte moves, so the integer view is exact.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def kv_buffer(layout: PageLayout, n_blocks: int, device: torch.device | str = "cpu",
              huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised buffer ``[L, 2, 1, H, n*B, D]`` for the KV of ``n_blocks`` blocks in
    transformers' layout (layer ``l``'s K is ``buf[l, 0]``), filled with :func:`unpack_into`.

    On the CPU the memory comes from numpy by default: numpy asks the kernel for huge pages
    on large arrays, and a fresh ``torch.empty`` of 190 MB paid a 4 KiB page fault per page
    of output (on a 2-core VM that doubled the time of one serial copy). ``huge_pages=False``
    takes plain pages: where the kernel compacts memory for huge pages on demand
    (``transparent_hugepage/defrag = madvise``), a huge-page fault now and then stalled for
    up to 0.5 s, and other threads' disk reads behind it; a restore that reads from disk,
    whose copies (and their faults) hide behind the reads, is better off without them."""
    L, H, B, D = layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim
    shape = (L, 2, 1, H, n_blocks * B, D)
    device = torch.device(device)
    if device.type != "cpu" or not huge_pages:
        return torch.empty(shape, dtype=layout.torch_dtype, device=device)
    np_int = {1: np.uint8, 2: np.int16, 4: np.int32}[layout.torch_dtype.itemsize]
    return torch.from_numpy(np.empty(shape, dtype=np_int)).view(layout.torch_dtype)


def kv_layers(layout: PageLayout, n_blocks: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)``, each an uninitialised ``[1, H, n*B, D]`` tensor of its own, for
    :func:`unpack_into`: what transformers' cache holds, and what a file loader returns.

    Why not one :func:`kv_buffer`: a buffer of hundreds of MB is a fresh ``mmap`` from the
    allocator every time, and every one of its pages is a page fault on first write (on the
    2-vCPU VM of docs/performance.md, first writes run at about 1 GB/s, slower than its disk
    reads). Tensors of a layer's size are what torch.load and safetensors allocate too; in a
    process that has restored before, a 189 MB restore into them took 0.25 CPU-s against
    0.32 into one buffer (docs/performance.md, "A cold restore is read through")."""
    L, H, B, D = layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim
    device = torch.device(device)
    shape = (1, H, n_blocks * B, D)
    return [(torch.empty(shape, dtype=layout.torch_dtype, device=device),
             torch.empty(shape, dtype=layout.torch_dtype, device=device)) for _ in range(L)]


def unpack_into(kv: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]], pages: torch.Tensor,
                first_block: int, layout: PageLayout, layers: tuple[int, int] | None = None) -> None:
    """Copy pages ``[k, L, 2, B, H, D]`` (any strides, e.g. a run of a pool) into blocks
    ``first_block .. first_block + k`` of a :func:`kv_buffer` or of :func:`kv_layers`; only
    layers ``[layers[0], layers[1])`` when given (see :func:`_copy` for how)."""
    layout.check_pages(pages)
    k = pages.shape[0]
    L, H, B, D = layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim
    per_layer = not isinstance(kv, torch.Tensor)
    n_total = (kv[0][0].shape[2] if per_layer else kv.shape[4]) // B  # type: ignore[index]
    if first_block < 0 or first_block + k > n_total:
        raise PageFormatError(f"blocks [{first_block}, {first_block + k}) outside a buffer of {n_total} blocks")
    lo, hi = layers if layers is not None else (0, L)
    if not 0 <= lo <= hi <= L:
        raise PageFormatError(f"layers [{lo}, {hi}) outside the layout's {L}")
    src = pages.permute(1, 2, 4, 0, 3, 5)[lo:hi]  # [k, L, 2, B, H, D] -> [L, 2, H, k, B, D]
    if not per_layer:
        assert isinstance(kv, torch.Tensor)
        _copy(kv.view(L, 2, H, n_total, B, D)[lo:hi, :, :, first_block : first_block + k], src)
        return
    for layer in range(lo, hi):
        for c in (0, 1):
            dst = kv[layer][c]
            if tuple(dst.shape) != (1, H, n_total * B, D):
                raise PageFormatError(f"layer {layer}'s KV has shape {tuple(dst.shape)}, expected {(1, H, n_total * B, D)}")
            _copy(dst.view(H, n_total, B, D)[:, first_block : first_block + k], src[layer - lo, c])


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for a permuted view; on the CPU through numpy: torch's strided
    ``copy_`` of this permutation ran at a quarter of memcpy speed on 2 cores (0.44 s against
    0.11 s for 190 MB), numpy's ``copyto`` at memcpy speed (and without the GIL)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        as_int = _INT_OF_WIDTH[src.dtype.itemsize]
        np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())
    else:
        # The copy may run on a helper thread (Lease.kv_into's), where the caller's
        # inference mode is off (it is per thread), into a cache the caller made inside it:
        # an in-place update of an inference tensor is allowed only in inference mode.
        with torch.inference_mode(dst.is_inference()):
            dst.copy_(src.to(dst.device))


def split_layers(kv: torch.Tensor, n_tokens: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` ``[1, H, T, D]`` views of a :func:`kv_buffer` (its first
    ``n_tokens`` tokens; contiguous when all of them)."""
    n = kv.shape[4] if n_tokens is None else n_tokens
    return [(kv[layer, 0, :, :, :n], kv[layer, 1, :, :, :n]) for layer in range(kv.shape[0])]


def unpack_pages(pages: torch.Tensor, layout: PageLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`pack_pages`: pages ``[n, L, 2, B, H, D]`` (any strides, e.g. a run of
    a pool) to per-layer ``(K, V)`` of shape ``[1, H, n*B, D]``, contiguous, in one new buffer
    filled by a single permuted copy (never a view of the pages)."""
    layout.check_pages(pages)
    kv = kv_buffer(layout, pages.shape[0], pages.device)
    unpack_into(kv, pages, 0, layout)
    return split_layers(kv)
