"""fp8 KV cache kernels for vLLM's CPU backend on hosts without AVX-512 (tests only).

vLLM 0.32's CPU backend keeps fp8 KV caches (``kv_cache_dtype`` fp8/fp8_e4m3/fp8_e5m2)
only with its AVX-512 build; elsewhere the engine refuses to start. To run the connector
with a real engine whose KV cache *is* fp8 - vLLM allocating it as uint8, the scheduler,
the layers' k/v scales, the connector's identity - :func:`emulated_fp8_kernels` replaces
the three CPU attention ops with plain torch versions for fp8 caches only:

* cache writes quantise K and V to fp8 codes (``x / scale``) and store the bytes, one token
  per row of each (block, head) tile (the tile's byte order is the kernel's business; pages
  copy whole tiles, so any order round-trips);
* attention dequantises the blocks of each sequence and runs causal softmax attention in
  float32 (GQA by repeating KV heads).

The logits differ from the AVX-512 kernels' (other order of float operations), but both
the run without tierkv and the runs with it use the same kernels, which is what a
"same output with and without tierkv" test needs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _reshape_and_cache(original):
    def op(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=1.0, v_scale=1.0,
           kv_cache_dtype="auto"):
        if kv_cache_dtype not in FP8:
            return original(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=k_scale,
                            v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
        fp8 = FP8[kv_cache_dtype]
        n = key_cache.shape[2]
        slots = slot_mapping.long()
        valid = slots >= 0  # padding tokens have slot -1
        slots, t = slots[valid], torch.nonzero(valid).flatten()
        block, offset = slots // n, slots % n
        key_cache[block, :, offset] = (key[t].float() / k_scale).to(fp8).view(torch.uint8)
        value_cache[block, :, offset] = (value[t].float() / v_scale).to(fp8).view(torch.uint8)

    return op


def _attention(original):
    def op(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,
           sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal=None, k_scale=1.0,
           v_scale=1.0, kv_cache_dtype="auto"):
        if kv_cache_dtype not in FP8:
            return original(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
                            alibi_slopes, sliding_window, block_table, softcap, scheduler_metadata, s_aux,
                            dynamic_causal, k_scale, v_scale, kv_cache_dtype)
        assert alibi_slopes is None and sliding_window == -1 and not softcap and s_aux is None and causal
        fp8 = FP8[kv_cache_dtype]
        n, H, D = key_cache.shape[2], key_cache.shape[1], key_cache.shape[3]
        Hq = query.shape[1]
        qsl = query_start_loc.tolist()
        for i, seq_len in enumerate(seq_lens.tolist()):
            q = query[qsl[i]:qsl[i + 1]].float()  # [q_len, Hq, D]
            q_len = q.shape[0]
            if q_len == 0:
                continue
            blocks = block_table[i, : -(-seq_len // n)].long()

            def dequant(cache, s):
                x = cache[blocks].view(fp8).float() * s  # [nb, H, n, D]
                return x.permute(0, 2, 1, 3).reshape(-1, H, D)[:seq_len].repeat_interleave(Hq // H, dim=1)

            k, v = dequant(key_cache, k_scale), dequant(value_cache, v_scale)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            pos_q = torch.arange(seq_len - q_len, seq_len)[:, None]
            scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos_q, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
            output[qsl[i]:qsl[i + 1]] = out.reshape(output[qsl[i]:qsl[i + 1]].shape).to(output.dtype)

    return op


def _scheduler_metadata(original):
    def op(*args, kv_cache_dtype="auto", **kw):
        return original(*args, kv_cache_dtype="auto", **kw)  # the plan for the float caches' kernel

    return op


@contextlib.contextmanager
def emulated_fp8_kernels() -> Iterator[None]:
    """Within: vLLM's CPU backend accepts fp8 KV caches on this host, with the torch kernels above."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    real_isa = cpu_attn._get_attn_isa

    def isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
        return real_isa(dtype, block_size, head_size, None)  # what it picks for float caches

    with mock.patch.object(cpu_attn, "_get_attn_isa", isa), \
            mock.patch.object(ops, "cpu_attn_reshape_and_cache", _reshape_and_cache(ops.cpu_attn_reshape_and_cache)), \
            mock.patch.object(ops, "cpu_attention_with_kv_cache", _attention(ops.cpu_attention_with_kv_cache)), \
            mock.patch.object(ops, "cpu_attn_get_scheduler_metadata",
                              _scheduler_metadata(ops.cpu_attn_get_scheduler_metadata)):
        yield
