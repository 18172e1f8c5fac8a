"""Page codecs: the form pages take in the host and disk tiers.

The device tier always holds pages in the engine's exact format (``PageLayout``: kernels and
integrations read it in place). The host and disk tiers hold the *stored form* of a page,
which the home's codec, fixed when the home is created (index meta ``page_codec``), defines:

- ``none`` (the default): the stored form is the page itself, byte for byte.
- ``int8``: symmetric int8 with power-of-two scales kept in the page. The page's values
  ``[L, 2, B, H, D]`` are cut into groups of ``block_size`` values, one per (layer, K/V,
  head, channel): a channel's values over the block's tokens. Each group keeps
  ``q = round(x / 2**e)`` as int8 and its exponent ``e`` as one signed byte. Stored form:
  ``numel`` int8 values (in the page's order), then ``L*2*H*D`` exponent bytes (in
  ``[L, 2, H, D]`` order): ``numel * (1 + 1/block_size)`` bytes (:attr:`PageCodec.stored_bytes`).

Why power-of-two scales (the OCP Microscaling MXINT8 choice, with one shared E8M0-like
exponent per group): decoding ``q * 2**e`` is exact in bfloat16, float16 and float32 (``q``
has 7 significant bits), so *encoding a decoded page gives back the same bytes*. A block
promoted from the disk to the device tier and demoted again is re-encoded to exactly the
bytes its checksum was taken over, and encoding is the same on a CPU and a GPU (every step
is an exact IEEE operation). A float scale ``absmax / 127`` is about 1.4x more accurate on
average but loses that property (the decoded value is rounded to the page's dtype), so a
re-encoded page would fail its checksum and be dropped. Rejected for the same reason:
scales in the page's own dtype.

Why per-channel groups (KIVI's choice for keys, whose channels differ in magnitude):
measured with scripts/codec_groups.py on scripts/bench_ttft.py's model (docs/performance-history.md,
"int8 pages"), they had about half the RMS error of one scale per (token, head) or per
(head, block), for both K and V, at 1 byte of scale per ``block_size`` values (bfloat16
pages of 16-token blocks: 0.53 of the exact bytes instead of 0.51).

``e`` is chosen as the least exponent with ``max|x| / 2**e <= 127``, clamped below at the
smallest exponent whose multiples the page dtype holds exactly (float16: -24; bfloat16 and
float32: -126). Non-finite values cannot be encoded: a put of such pages raises
PageFormatError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import CodecMismatchError, PageFormatError
from .layout import ALIGN, PageLayout, round_up

if TYPE_CHECKING:
    from .index import Index

CODECS = ("none", "int8")
DEFAULT_CODEC = "none"
_QMAX = 127
# The least exponent whose multiples q * 2**e (|q| <= 127) the dtype represents exactly.
_MIN_EXP = {torch.float16: -24, torch.bfloat16: -126, torch.float32: -126}
# The largest: 2**-e stays a normal float32 (max|x| of a float32 or bfloat16 page is below
# 2**128); float16's largest finite value is 65504, and 127 * 2**9 = 65024 stays finite.
_MAX_EXP = {torch.float16: 9, torch.bfloat16: 126, torch.float32: 126}


@dataclass(frozen=True)
class PageCodec:
    """How pages of ``layout`` are stored in the host and disk tiers (see the module doc)."""

    name: str
    layout: PageLayout

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"page_codec must be one of {CODECS}, got {self.name!r}")
        if self.name == "int8" and self.layout.torch_dtype not in _MIN_EXP:
            raise ValueError(f"page_codec 'int8' needs a float16, bfloat16 or float32 layout, not {self.layout.dtype}")

    @property
    def exact(self) -> bool:
        """Whether the stored form is the page itself."""
        return self.name == "none"

    @property
    def groups(self) -> int:
        """Scale groups per page (one per layer, K/V, head and channel)."""
        L, _, _, H, D = self.layout.shape
        return L * 2 * H * D

    @property
    def stored_bytes(self) -> int:
        """Bytes of one page's stored form."""
        if self.exact:
            return self.layout.page_bytes
        return self.layout.numel + self.groups

    @property
    def slot_bytes(self) -> int:
        """Bytes one stored page occupies in an aligned pool (host memory, disk segments)."""
        return round_up(self.stored_bytes, ALIGN)

    def is_stored_form(self, pages: torch.Tensor) -> bool:
        """Whether ``pages`` (one page or a batch) is already in the stored form."""
        if self.exact:
            return True
        return pages.dtype == torch.uint8 and pages.shape[-1:] == (self.stored_bytes,)

    def to_stored(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages ``[*, L, 2, B, H, D]`` (or already stored) in the stored form: ``[*, stored_bytes]``
        uint8 on the same device (``exact``: the pages themselves, no copy)."""
        if self.exact or self.is_stored_form(pages):
            return pages
        return encode_int8(pages, self.layout)

    def to_layout(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages in the layout's form (decoded if stored), on the same device."""
        if self.exact or pages.dtype == self.layout.torch_dtype:
            return pages
        return decode_int8(pages, self.layout)

    def is_layout_form(self, pages: torch.Tensor) -> bool:
        return self.exact or pages.dtype == self.layout.torch_dtype

    def decode_into(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """Decode stored pages into ``out`` (contiguous pages of the layout, same device)."""
        decode_int8(stored, self.layout, out)

    def to_json(self) -> str:
        return self.name


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponents`` as float32, built from the bits (exact, unlike exp2 on every backend);
    ``exponents`` must lie in [-126, 127]."""
    return ((exponents.to(torch.int32) + 127) << 23).view(torch.float32)


def _np_pow2(exponents: np.ndarray) -> np.ndarray:
    return ((exponents.astype(np.int32) + 127) << 23).view(np.float32)


def _np_float32(x: torch.Tensor) -> np.ndarray:
    """A CPU page batch as float32 numpy, exactly (numpy has no bfloat16: its bits shifted
    into the high half of a float32 are the same number)."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    return x.numpy().astype(np.float32, copy=False)


def encode_int8(pages: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Pages ``[*, L, 2, B, H, D]`` in ``layout``'s dtype to ``[*, stored_bytes]`` uint8, on
    the pages' device (numpy on the CPU: 3x faster than torch's kernels on few cores)."""
    lead = tuple(pages.shape[: pages.dim() - 5])
    if tuple(pages.shape[-5:]) != layout.shape or pages.dtype != layout.torch_dtype:
        raise PageFormatError(f"pages of shape {tuple(pages.shape)} and dtype {pages.dtype} are not of layout {layout.to_json()}")
    B, HD, numel = layout.block_size, layout.num_kv_heads * layout.head_dim, layout.numel
    lo, hi = _MIN_EXP[layout.torch_dtype], _MAX_EXP[layout.torch_dtype]
    out = torch.empty((*lead, numel + numel // B), dtype=torch.uint8, device=pages.device)
    flat = out.reshape(-1, out.shape[-1])
    pages = pages.detach().contiguous()
    if pages.device.type == "cpu":
        _encode_numpy(pages, flat, B, HD, lo, hi)
    else:
        _encode_torch(pages, flat, B, HD, lo, hi)
    return out


# Pages seen as [n * L * 2, B, H * D]: a group is one column (a channel of a head) over the
# block's B tokens, so its scale broadcasts along axis 1 with no transposed copy.
def _encode_numpy(pages: torch.Tensor, flat: torch.Tensor, B: int, HD: int, lo: int, hi: int) -> None:
    numel = flat.shape[1] - flat.shape[1] // (B + 1)
    x = _np_float32(pages).reshape(-1, B, HD)
    amax = np.abs(x).max(axis=1) if x.size else np.zeros((0, HD), np.float32)
    _check_finite(bool(np.isfinite(amax).all()))
    # amax = m * 2**k, m in [0.5, 1): the least e with amax / 2**e <= 127 is k - 7, or
    # k - 6 when m > 127/128 (both exact: scaling by powers of two is exact).
    m, k = np.frexp(amax)
    e = np.clip(k - 7 + (m > _QMAX / 128), lo, hi).astype(np.int8)
    y = x * _np_pow2(-e.astype(np.int32))[:, None, :]
    np.rint(y, out=y)
    np.clip(y, -_QMAX, _QMAX, out=y)  # only float16's clamped exponent reaches past 127
    fnp = flat.numpy()
    fnp[:, :numel] = y.astype(np.int8).reshape(flat.shape[0], numel).view(np.uint8)
    fnp[:, numel:] = e.view(np.uint8).reshape(flat.shape[0], -1)


def _encode_torch(pages: torch.Tensor, flat: torch.Tensor, B: int, HD: int, lo: int, hi: int) -> None:
    """The same on any device (the CUDA path; tests check it equals the numpy one)."""
    numel = flat.shape[1] - flat.shape[1] // (B + 1)
    x = pages.reshape(-1, B, HD).float()
    amax = x.abs().amax(dim=1)
    _check_finite(bool(torch.isfinite(amax).all()))
    mt, kt = torch.frexp(amax)
    et = (kt - 7 + (mt > _QMAX / 128).to(kt.dtype)).clamp_(lo, hi)
    q = torch.round(x * _pow2(-et).unsqueeze(1)).clamp_(-_QMAX, _QMAX).to(torch.int8)
    flat[:, :numel] = q.view(torch.uint8).reshape(flat.shape[0], numel)
    flat[:, numel:] = et.to(torch.int8).view(torch.uint8).reshape(flat.shape[0], -1)


def _check_finite(finite: bool) -> None:
    if not finite:
        raise PageFormatError("pages hold non-finite values, which the int8 page codec cannot store",
                              hint="store them in a home with page_codec 'none'")


def decode_int8(stored: torch.Tensor, layout: PageLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[*, stored_bytes]`` uint8 back to pages ``[*, L, 2, B, H, D]`` in ``layout``'s dtype
    (exact products: ``q`` has 7 significant bits and the scale is a power of two), into
    ``out`` when given (contiguous, on the same device: a device slot, with no buffer in
    between; a fresh 190 MB buffer cost its page faults on every restore)."""
    numel, B, HD = layout.numel, layout.block_size, layout.num_kv_heads * layout.head_dim
    lead = tuple(stored.shape[:-1])
    flat = stored.detach().reshape(-1, stored.shape[-1])
    if stored.dtype != torch.uint8 or flat.shape[1] != numel + numel // B:
        raise PageFormatError(f"{tuple(stored.shape)} {stored.dtype} is not an int8-coded page of layout {layout.to_json()}")
    lo, hi = _MIN_EXP[layout.torch_dtype], _MAX_EXP[layout.torch_dtype]
    if out is None:
        out = torch.empty((*lead, *layout.shape), dtype=layout.torch_dtype, device=stored.device)
    elif out.numel() != flat.shape[0] * numel or out.dtype != layout.torch_dtype or not out.is_contiguous() \
            or out.device != stored.device:
        raise PageFormatError(f"cannot decode {tuple(stored.shape)} into {tuple(out.shape)} {out.dtype} on {out.device}")
    if stored.device.type == "cpu":
        _decode_numpy(flat, out, numel, B, HD, lo, hi)
    else:
        _decode_torch(flat, out, numel, B, HD, lo, hi)
    return out


def _decode_numpy(flat: torch.Tensor, out: torch.Tensor, numel: int, B: int, HD: int, lo: int, hi: int) -> None:
    fnp = flat.numpy()
    q = fnp[:, :numel].view(np.int8).reshape(-1, B, HD)
    e = np.clip(fnp[:, numel:].view(np.int8).reshape(-1, HD), lo, hi)
    scale = _np_pow2(e)[:, None, :]
    if out.dtype == torch.bfloat16:  # exact in bfloat16: its bits are the high half
        x = np.multiply(q, scale, dtype=np.float32)
        np.right_shift(x.view(np.uint32), 16, out=out.view(torch.int16).numpy().reshape(x.shape).view(np.uint16),
                       casting="unsafe")
    else:  # float32, or float16 (exact: a same-kind cast of exactly representable values)
        np.multiply(q, scale, out=out.numpy().reshape(q.shape), casting="same_kind")


def _decode_torch(flat: torch.Tensor, out: torch.Tensor, numel: int, B: int, HD: int, lo: int, hi: int) -> None:
    q = flat[:, :numel].view(torch.int8).reshape(-1, B, HD)
    e = flat[:, numel:].view(torch.int8).reshape(-1, HD).clamp(lo, hi)
    out.view(-1, B, HD).copy_(q.float() * _pow2(e).unsqueeze(1))


def open_home_codec(index: "Index", requested: str | None, layout: PageLayout, home: object) -> PageCodec:
    """The codec of the home whose index is ``index``, fixed when the home was created.

    A new home (no ``layout`` meta yet) records ``requested`` (default ``none``); an existing
    one keeps its own (a home made before codecs has none recorded: ``none``). Raises
    CodecMismatchError when ``requested`` is given and differs from the home's."""
    if index.get_meta("layout") is None:
        codec = PageCodec(requested or DEFAULT_CODEC, layout)
        index.put_meta("page_codec", codec.name)
        return codec
    recorded = index.get_meta("page_codec") or DEFAULT_CODEC
    if requested is not None and requested != recorded:
        raise CodecMismatchError(
            f"{home} stores pages with page codec {recorded!r}, asked for {requested!r}",
            hint=f"open it with page_codec={recorded!r} (--page-codec {recorded}) or without one, or use another home")
    return PageCodec(recorded, layout)
