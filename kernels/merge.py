"""Merging softmax states: parts of one attention computed over disjoint KV ranges.

A part is ``(out, lse)``: its normalised output and the log-sum-exp of its scores. Two parts
combine exactly as ``lse = logaddexp(lse_a, lse_b)`` and ``out = out_a * exp(lse_a - lse) +
out_b * exp(lse_b - lse)``, in fp32. An empty part has ``lse = -inf``; the guards below make
"both empty" give output 0 and ``lse = -inf`` instead of NaN from ``-inf - -inf`` or 0/0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import AttentionOutput, KernelInputError


@triton.jit
def _merge_partials_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, num_parts,
    s_pn, s_ph, s_pp, s_pd,
    s_qn, s_qh, s_qp,
    s_on, s_oh, s_od,
    s_ln, s_lh,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_base = part_lse_ptr + n * s_qn + h * s_qh
    m = tl.max(tl.full([BLOCK_P], float("-inf"), tl.float32), 0)
    for p0 in range(0, num_parts, BLOCK_P):
        part_lse = tl.load(lse_base + (p0 + p) * s_qp, mask=p0 + p < num_parts, other=float("-inf"))
        m = tl.maximum(m, tl.max(part_lse, 0))
    # All parts empty: m = -inf. Shift by 0 instead so exp(-inf - 0) = 0, not NaN.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.sum(tl.zeros([BLOCK_P], tl.float32), 0)
    for p0 in range(0, num_parts, BLOCK_P):
        p_ok = p0 + p < num_parts
        part_lse = tl.load(lse_base + (p0 + p) * s_qp, mask=p_ok, other=float("-inf"))
        w = tl.exp(part_lse - m_safe)
        o = tl.load(part_ptr + n * s_pn + h * s_ph + (p0 + p)[:, None] * s_pp + d[None, :] * s_pd,
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        # where, not w * o: an empty part's output is never trusted, even if it is 0.
        acc += tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0), 0)
        total += tl.sum(w, 0)
    has = total > 0.0
    out = acc / tl.where(has, total, 1.0)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    tl.store(out_ptr + n * s_on + h * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + n * s_ln + h * s_lh, lse)


def merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Combine ``part_out [N, Hq, P, D]`` / ``part_lse [N, Hq, P]`` into ``out``/``lse`` in place.

    Parts with ``lse = -inf`` weigh nothing; a row whose parts are all empty gets output 0
    and ``lse = -inf``. Internal: shapes are the caller's responsibility.
    """
    n, hq, num_parts, head_dim = part_out.shape
    block_d = triton.next_power_of_2(head_dim)
    block_p = min(16, triton.next_power_of_2(num_parts))
    _merge_partials_kernel[(n, hq)](
        part_out, part_lse, out, lse, num_parts,
        *part_out.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, BLOCK_P=block_p, BLOCK_D=block_d,
    )



@triton.jit
def _merge_states_kernel(
    a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    s_an, s_ah, s_ad, s_lan, s_lah,
    s_bn, s_bh, s_bd, s_lbn, s_lbh,
    s_on, s_oh, s_od, s_ln, s_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_a = tl.load(lse_a_ptr + n * s_lan + h * s_lah).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + n * s_lbn + h * s_lbh).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both empty: avoid -inf - -inf
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    o_a = tl.load(a_ptr + n * s_an + h * s_ah + d * s_ad, mask=d_ok, other=0.0).to(tl.float32)
    o_b = tl.load(b_ptr + n * s_bn + h * s_bh + d * s_bd, mask=d_ok, other=0.0).to(tl.float32)
    acc = tl.where(w_a > 0.0, w_a * o_a, 0.0) + tl.where(w_b > 0.0, w_b * o_b, 0.0)
    has = total > 0.0
    out = acc / tl.where(has, total, 1.0)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    tl.store(out_ptr + n * s_on + h * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + n * s_ln + h * s_lh, lse)


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> AttentionOutput:
    """Merge two attention parts over disjoint KV ranges of the same queries.

    ``out_* [N, H, D]`` (any float dtype, the result takes ``out_a``'s), ``lse_* [N, H]``
    (natural log, ``-inf`` for an empty part). The merge runs in fp32; both parts empty
    gives output 0 and ``lse = -inf``. Raises :class:`KernelInputError` on mismatched inputs.
    """
    if out_a.dim() != 3 or out_a.shape != out_b.shape:
        raise KernelInputError(
            f"out_a and out_b must both be [N, H, D], got {tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    if lse_a.shape != out_a.shape[:2] or lse_b.shape != out_a.shape[:2]:
        raise KernelInputError(f"lse_a and lse_b must be [N, H] = {tuple(out_a.shape[:2])}")
    tensors = (out_a, lse_a, out_b, lse_b)
    if any(t.device != out_a.device for t in tensors):
        raise KernelInputError("out_a, lse_a, out_b and lse_b must be on one device")
    if any(not t.is_floating_point() for t in tensors):
        raise KernelInputError("merge_states takes floating-point outputs and lse")
    out = torch.empty_like(out_a)
    lse = torch.empty(out_a.shape[:2], dtype=torch.float32, device=out_a.device)
    n, h, head_dim = out_a.shape
    if n * h == 0:
        return AttentionOutput(out, lse)
    _merge_states_kernel[(n, h)](
        out_a, lse_a, out_b, lse_b, out, lse,
        *out_a.stride(), *lse_a.stride(), *out_b.stride(), *lse_b.stride(),
        *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return AttentionOutput(out, lse)
