"""Attention of a batch of requests that share one leased prefix, as a transformers attention function.

transformers (5.x) looks the attention function of every layer up by name in
``AttentionInterface`` (``config._attn_implementation``) and calls it as ``fn(module, query,
key, value, attention_mask, scaling=..., **kwargs)`` with the model call's extra kwargs passed
through. :func:`register` adds ``"tierkv_cascade"``; :func:`swapped_attention` switches a
model to it for the duration of a batch; the per-batch state (:class:`BatchAttention`)
travels as the ``tierkv_batch`` kwarg of each model call. A name missing from
``AttentionMaskInterface`` makes transformers build no mask at all, which is what we want:
this module knows each request's lengths and masks by itself.

Each request's context is two parts: the shared prefix, ``shared_len`` tokens read in place
from leased device-tier pages (one table row for everyone), and its own suffix (its prompt
past ``shared_len`` and its generated tokens) in a small paged pool of the same page layout
(:class:`SuffixPages`). Attention is computed per part and merged by log-sum-exp:

* prefill (several tokens per request, once per batch): PyTorch. The layer's prefix K/V
  are gathered from the pages once for the batch (not once per request), and the scores
  over prefix and suffix go through one softmax, as eager attention does.
* decode (one token per request): ``tierkv.kernels``. The prefix part is the cascade's
  shared level (one read of the pages per step for all requests) when the batch asks for
  it, else the plain paged kernel with the prefix row repeated per request; the suffix part
  is the paged kernel over the suffix pool; ``merge_states`` combines them. One kernel call
  cannot cover both parts because they live in two pools: the store owns the device pool
  and lends no slots for per-request writes.

``tierkv.kernels`` is imported lazily: ``triton.jit`` fixes the interpreter mode
(``TRITON_INTERPRET``) when the kernels are first imported, and importing ``tierkv.hf``
must not fix it for the caller.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..layout import PageLayout
from .config import text_config

ATTN_NAME = "tierkv_cascade"
STATE_KWARG = "tierkv_batch"


@dataclass
class SuffixPages:
    """Per-request suffix K/V in a private pool ``[slots, L, 2, B, Hkv, D]``.

    Request ``n`` owns the slots listed in ``tables[n]`` (a contiguous run, padded with its
    first slot); ``lens[n]`` tokens of it are written. Only :class:`BatchAttention` writes.
    """

    pool: torch.Tensor
    tables: torch.Tensor  # [N, max_pages] int32
    lens: torch.Tensor  # [N] int64 on the host: tokens written per request
    pages: tuple[int, ...]  # pages owned by each request

    @classmethod
    def allocate(cls, layout: PageLayout, capacities: list[int], device: torch.device) -> "SuffixPages":
        """Room for ``capacities[n]`` tokens of request ``n`` (rounded up to whole pages)."""
        bs = layout.block_size
        pages = tuple(max(1, -(-cap // bs)) for cap in capacities)
        pool = torch.empty((sum(pages), *layout.shape), dtype=layout.torch_dtype, device=device)
        tables = torch.zeros((len(pages), max(pages, default=1)), dtype=torch.int32)
        first = 0
        for n, count in enumerate(pages):
            tables[n, :] = first  # padding entries are never read: the kernels mask them
            tables[n, :count] = torch.arange(first, first + count, dtype=torch.int32)
            first += count
        return cls(pool, tables.to(device), torch.zeros(len(pages), dtype=torch.int64), pages)

    def bytes_of(self, n: int) -> int:
        return self.pages[n] * self.pool[0].numel() * self.pool.element_size()

    def check_integrity(self) -> None:
        """Recompute ownership from the tables: every slot owned by exactly one request, as
        one run in token order, and no request holding more tokens than its pages."""
        bs, tables = self.pool.shape[3], self.tables.cpu()
        owner = torch.full((self.pool.shape[0],), -1, dtype=torch.int64)
        for n, count in enumerate(self.pages):
            run = tables[n, :count].long()
            assert bool((run == run[0] + torch.arange(count)).all()), f"request {n}'s pages are not one run"
            assert bool((owner[run] == -1).all()), f"request {n} shares a slot"
            owner[run] = n
            assert 0 <= int(self.lens[n]) <= count * bs, f"request {n} holds more tokens than its pages"
        assert bool((owner >= 0).all()), "a suffix slot belongs to no request"


@dataclass
class _Step:
    """What one model call of the batch needs; rebuilt by ``begin_*`` (layer independent)."""

    active: torch.Tensor  # [M] request ids of the rows of this call, on the host
    query_lens: torch.Tensor  # [M] new tokens per row (prefill pads rows to the longest)
    write_slot: torch.Tensor  # [K] suffix slot of each new token (K = sum of query_lens)
    write_off: torch.Tensor  # [K] offset in that slot
    write_row: torch.Tensor  # [K] row of the new token in the call
    write_tok: torch.Tensor  # [K] position of the new token in its row
    suffix_lens: torch.Tensor  # [M] suffix tokens after this call's writes, on the device
    suffix_tables: torch.Tensor  # [M, max_pages]
    longest_suffix: int  # max of suffix_lens: sizes split-K without a device sync per layer
    prefix_tables: torch.Tensor  # [M, prefix pages]: the prefix row once per request (plain path)
    prefix_lens: torch.Tensor  # [M] shared_len per request (plain path)
    decode: bool


class BatchAttention:
    """Attention state of one batch: the leased prefix, the suffix pages, the current step.

    The caller holds the lease for the object's whole life. ``begin_prefill``/``begin_decode``
    describe the next model call; the model's attention layers then call the object (through
    :func:`attention_forward`), which writes the call's new K/V into the suffix pages and
    returns the attention output. After the call the caller must run :meth:`end_step`.
    """

    def __init__(self, prefix_pool: torch.Tensor, prefix_slots: list[int], shared_len: int,
                 suffix: SuffixPages, num_q_heads: int, use_cascade: bool | None) -> None:
        self.prefix_pool = prefix_pool
        self.shared_len = shared_len
        self.suffix = suffix
        self.num_q_heads = num_q_heads
        self.use_cascade = use_cascade
        device = suffix.pool.device
        self.prefix_row = torch.tensor(prefix_slots or [0], dtype=torch.int32, device=device)
        self.cascade_steps = 0
        self.plain_steps = 0
        self._step: _Step | None = None
        self._plan: Any = None  # CascadePlan of the current active set, or None for plain
        self._plan_for: tuple[int, ...] | None = None

    # ---- step bookkeeping ------------------------------------------------------------
    def _begin(self, active: list[int], query_lens: list[int], decode: bool) -> None:
        bs, device = self.suffix.pool.shape[3], self.suffix.pool.device
        ids = torch.tensor(active, dtype=torch.int64)
        counts = torch.tensor(query_lens, dtype=torch.int64)
        before = self.suffix.lens[ids]
        after = before + counts
        capacity = torch.tensor([self.suffix.pages[n] for n in active], dtype=torch.int64) * bs
        assert bool((after <= capacity).all()), "a request outgrew its suffix pages (sized by generate_batch)"
        # One entry per new token: its row and position in the call, and where it is stored.
        rows = torch.repeat_interleave(torch.arange(len(active)), counts)
        toks = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        pos = before[rows] + toks
        tables = self.suffix.tables.cpu()[ids]
        slots = tables[rows, pos // bs]
        m = len(active)
        self._step = _Step(
            active=ids, query_lens=counts.to(device), write_slot=slots.to(device), write_off=(pos % bs).to(device),
            write_row=rows.to(device), write_tok=toks.to(device), suffix_lens=after.to(device, torch.int32),
            suffix_tables=tables.to(device), longest_suffix=int(after.max()) if m else 0,
            prefix_tables=self.prefix_row[None, :].expand(m, -1),
            prefix_lens=torch.full((m,), self.shared_len, dtype=torch.int32, device=device), decode=decode,
        )

    def begin_prefill(self, active: list[int], query_lens: list[int]) -> None:
        """The next call feeds ``query_lens[i]`` tokens (right-padded) of request ``active[i]``."""
        self._begin(active, query_lens, decode=False)

    def begin_decode(self, active: list[int]) -> None:
        """The next call feeds one token of each request in ``active``."""
        self._begin(active, [1] * len(active), decode=True)
        key = tuple(active)
        if key != self._plan_for:
            self._plan, self._plan_for = self._build_plan(active), key
        if self._plan is None:
            self.plain_steps += 1
        else:
            self.cascade_steps += 1

    def end_step(self) -> None:
        """Record the tokens the last call wrote."""
        assert self._step is not None, "end_step without begin_*"
        step = self._step
        self.suffix.lens[step.active] = step.suffix_lens.cpu().long()
        self._step = None

    def _build_plan(self, active: list[int]) -> Any:
        from ..kernels import SharedLevel, plan_cascade, should_use_cascade

        m, pool = len(active), self.prefix_pool
        if self.shared_len == 0:
            return None
        use = self.use_cascade
        if use is None:
            mean_suffix = int(self.suffix.lens[torch.tensor(active)].float().mean()) if m else 0
            use = should_use_cascade(m, self.shared_len, self.num_q_heads, pool.shape[4], suffix_len=mean_suffix,
                                     head_dim=pool.shape[5], dtype_bytes=pool.element_size())
        if not use:
            return None
        def ints(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int32, device=pool.device)

        # One group holding every running request; the suffix lives in another pool, so the
        # plan's own suffix pass is given empty ranges.
        level = SharedLevel(self.prefix_row[None, :], ints(1, fill=self.shared_len), ints(m))
        return plan_cascade(pool, self.num_q_heads, [level], ints(m, 1), ints(m))

    # ---- attention -------------------------------------------------------------------
    def _write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        s = self._step
        assert s is not None
        pool = self.suffix.pool
        # key [M, Hkv, T, D] -> the new tokens [K, Hkv, D], each into its own (slot, offset).
        pool[s.write_slot, layer, 0, s.write_off] = key[s.write_row, :, s.write_tok].to(pool.dtype)
        pool[s.write_slot, layer, 1, s.write_off] = value[s.write_row, :, s.write_tok].to(pool.dtype)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """Attention output ``[M, T, Hq, D]`` of ``query [M, Hq, T, D]``; ``key``/``value``
        ``[M, Hkv, T, D]`` are the call's new tokens (after rotary), stored here first."""
        assert self._step is not None, "model called without begin_prefill/begin_decode"
        self._write(layer, key, value)
        if self._step.decode:
            return self._decode(layer, query[:, :, 0], scaling).unsqueeze(1)
        return self._prefill(layer, query, key, value, scaling)

    def _prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[Hkv, shared_len, D]`` of the prefix, gathered once for the whole batch."""
        pages = self.prefix_pool[self.prefix_row.long(), layer]  # [nb, 2, B, Hkv, D]
        kv = pages.permute(1, 3, 0, 2, 4).flatten(2, 3)[:, :, : self.shared_len]  # [2, Hkv, nb*B, D]
        return kv[0], kv[1]

    def _prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float) -> torch.Tensor:
        s = self._step
        assert s is not None
        m, hq, t, d = query.shape
        hkv = key.shape[1]
        q = query.reshape(m, hkv, hq // hkv, t, d)
        if self.shared_len:
            k_pre, v_pre = (x.to(query.dtype) for x in self._prefix_kv(layer))
        else:
            k_pre = v_pre = query.new_zeros((hkv, 0, d))
        # Multiply in the model's dtype, softmax in fp32, as transformers' eager attention does.
        scores_pre = torch.einsum("mhgtd,hpd->mhgtp", q, k_pre) * scaling
        scores_own = torch.einsum("mhgtd,mhsd->mhgts", q, key) * scaling
        pos = torch.arange(t, device=query.device)
        visible = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < s.query_lens[:, None, None])
        scores_own = scores_own.masked_fill(~visible[:, None, None], float("-inf"))
        probs = torch.softmax(torch.cat([scores_pre, scores_own], dim=-1), dim=-1, dtype=torch.float32)
        probs = probs.to(query.dtype)
        p_pre, p_own = probs[..., : self.shared_len], probs[..., self.shared_len :]
        out = torch.einsum("mhgtp,hpd->mhgtd", p_pre, v_pre) + torch.einsum("mhgts,mhsd->mhgtd", p_own, value)
        return out.reshape(m, hq, t, d).transpose(1, 2)

    def _decode(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        from ..kernels import cascade_attention, merge_states, paged_decode_attention

        s = self._step
        assert s is not None
        own = paged_decode_attention(q, self.suffix.pool, layer, s.suffix_tables, s.suffix_lens, sm_scale=scaling,
                                     max_kv_len=s.longest_suffix)
        if self.shared_len == 0:
            return own.out
        if self._plan is not None:
            pre = cascade_attention(q, self.prefix_pool, layer, self._plan, sm_scale=scaling)
        else:
            pre = paged_decode_attention(q, self.prefix_pool, layer, s.prefix_tables, s.prefix_lens,
                                         sm_scale=scaling, max_kv_len=self.shared_len)
        return merge_states(pre.out, pre.lse, own.out, own.lse).out


def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"tierkv_cascade"`` entry of transformers' ``AttentionInterface``.

    Needs the ``tierkv_batch`` kwarg (a :class:`BatchAttention`) on the model call; raises
    RuntimeError without it (the model was left switched to this implementation).
    """
    state = kwargs.get(STATE_KWARG)
    if not isinstance(state, BatchAttention):
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} called without the {STATE_KWARG!r} argument; "
            "it is meant for tierkv.hf.batch.generate_batch only"
        )
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported:
        # Gemma-2 logit soft-capping, gpt-oss attention sinks: neither kernel computes them.
        raise ConfigError(f"{ATTN_NAME} does not implement {', '.join(unsupported)}",
                          hint="generate these prompts one at a time with tierkv.hf.generate")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return state.forward(module.layer_idx, query, key, value, scale), None


def register() -> None:
    """Add ``"tierkv_cascade"`` to transformers' attention functions (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention_forward)


@contextlib.contextmanager
def swapped_attention(model: Any) -> Iterator[None]:
    """Run ``model`` with ``"tierkv_cascade"`` attention inside the block, restoring its own
    after. The switch is on the shared config: do not run the model elsewhere meanwhile."""
    register()
    text = text_config(model.config)
    configs = {id(c): c for c in (model.config, text) if c is not None}
    saved = {key: c._attn_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = ATTN_NAME
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = saved[key]
