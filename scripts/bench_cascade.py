#!/usr/bin/env python3
"""Decode attention over a paged pool with a shared prefix: candidates side by side.

    python scripts/bench_cascade.py                 # all shapes, human table (needs a GPU)
    python scripts/bench_cascade.py --shapes A,C    # a subset
    python scripts/bench_cascade.py --json          # ... and one JSON object as the last line
    python scripts/bench_cascade.py --smoke         # tiny shapes; runs on CPU (interpreter)

Every candidate reads the same pool ``[slots, layers, 2, 16, Hkv, 128]`` (bf16) with the
prefix pages shared by all N requests and each request's suffix pages scattered over it:

  gather_sdpa   gather each request's pages into a contiguous cache, then torch SDPA
  plain         tierkv paged decode kernel over each request's full block table
  cascade       tierkv cascade: the prefix once for all N, suffixes, merge
  flashinfer_*  FlashInfer decode / multi-level cascade, only if importable

Per candidate: median microseconds (``triton.testing.do_bench``; perf_counter on CPU),
``eff_bw`` = bytes its algorithm must read (plain-type methods: every request's whole
context; cascade: the model's cascade bytes) / time, as a fraction of the measured copy
bandwidth, and ``floor_frac`` = (unique bytes: prefix once + suffixes + q + out) / copy
bandwidth / time, i.e. how close it gets to the fastest any method could be. ``rule`` is
what :func:`tierkv.kernels.should_use_cascade` picks; compare it with the faster of
plain/cascade to confirm or retune the thresholds in kernels/policy.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tierkv.kernels defines its kernels

import torch.nn.functional as F
import triton
from tierkv.kernels import (
    SharedLevel,
    cascade_attention,
    estimate_decode,
    paged_decode_attention,
    plan_cascade,
    should_use_cascade,
)
from tierkv.kernels.policy import CostModel


class Shape(NamedTuple):
    name: str
    n: int  # requests sharing the prefix
    prefix: int
    suffix: int
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    block: int = 16


def full_shapes() -> list[Shape]:
    shapes = [Shape("A", 64, 8192, 256), Shape("B", 128, 32768, 256), Shape("C", 16, 1024, 1024)]
    shapes += [Shape(f"P{p}", 64, p, 256) for p in (256, 1024, 8192)]
    shapes += [Shape(f"N{n}", n, 8192, 256) for n in (8, 16, 32, 64, 128)]
    return shapes


def smoke_shapes() -> list[Shape]:
    return [Shape("smoke", 3, 24, 8, hq=8, hkv=2, head_dim=16, block=4),
            Shape("smoke_gqa8", 2, 16, 4, hq=8, hkv=1, head_dim=16, block=4)]


def timed(fn: Callable[[], object], device: torch.device, graph: bool = False) -> float:
    """Median microseconds of ``fn``; with ``graph``, replayed from a CUDA graph (no launch cost)."""
    if device.type == "cuda":
        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, return_mode="median")) * 1e3
        return float(triton.testing.do_bench(fn, return_mode="median")) * 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def graph_time(fn: Callable[[], object], device: torch.device) -> float | None:
    """CUDA-graph time, or None on CPU or where capture fails (e.g. a host sync inside)."""
    if device.type != "cuda":
        return None
    try:
        return round(timed(fn, device, graph=True), 2)
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot be captured just has no graph time
        print(f"cuda graph capture failed: {exc!r}")
        return None


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 22)
    src = torch.empty(numel, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * numel / (timed(lambda: dst.copy_(src), device) * 1e-6)


class Case(NamedTuple):
    q: torch.Tensor
    pool: torch.Tensor
    full_tables: torch.Tensor  # [N, prefix + suffix pages]
    seq_lens: torch.Tensor
    prefix_table: torch.Tensor  # [1, prefix pages]
    suffix_tables: torch.Tensor  # [N, suffix pages]


def make_case(shape: Shape, dtype: torch.dtype, device: torch.device, layers: int = 2) -> Case:
    prefix_pages = triton.cdiv(shape.prefix, shape.block)
    suffix_pages = triton.cdiv(shape.suffix, shape.block)
    slots = prefix_pages + shape.n * suffix_pages
    pool = torch.randn(slots, layers, 2, shape.block, shape.hkv, shape.head_dim, device=device, dtype=dtype)
    order = torch.randperm(slots, device=device).to(torch.int32)  # scattered pages, as after churn
    prefix = order[:prefix_pages].view(1, -1)
    suffix = order[prefix_pages:].view(shape.n, suffix_pages)
    full = torch.cat([prefix.expand(shape.n, -1), suffix], dim=1).contiguous()
    # The prefix owns whole pages; the suffix starts on the next page.
    seq_lens = torch.full((shape.n,), prefix_pages * shape.block + shape.suffix, device=device, dtype=torch.int32)
    q = torch.randn(shape.n, shape.hq, shape.head_dim, device=device, dtype=dtype)
    return Case(q, pool, full, seq_lens, prefix, suffix)


def gather_sdpa(case: Case, shape: Shape, layer: int) -> Callable[[], torch.Tensor]:
    pages = case.full_tables.long()
    valid = int(case.seq_lens[0])  # equal lengths in this benchmark

    def run() -> torch.Tensor:
        kv = case.pool[pages, layer]  # [N, pages, 2, B, Hkv, D]: the copy this method pays for
        k = kv[:, :, 0].flatten(1, 2).transpose(1, 2)  # [N, Hkv, T, D]
        v = kv[:, :, 1].flatten(1, 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(case.q.unsqueeze(2), k[:, :, :valid], v[:, :, :valid], enable_gqa=True)
        return out.squeeze(2)

    return run


def flashinfer_candidates(case: Case, shape: Shape, layer: int) -> dict[str, Callable[[], torch.Tensor]]:
    """FlashInfer decode and two-level cascade on the same pages, when it can run at all."""
    try:
        import flashinfer  # type: ignore[import-not-found]
    except ImportError:
        return {}
    device, n = case.q.device, shape.n
    cache = case.pool[:, layer]  # [slots, 2, B, Hkv, D], NHD layout, strided over layers
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    found: dict[str, Callable[[], torch.Tensor]] = {}

    def indptr(rows: torch.Tensor) -> torch.Tensor:
        return torch.arange(0, rows.numel() + 1, rows.shape[1], device=device, dtype=torch.int32)

    def last_len(tokens: int, rows: int) -> torch.Tensor:
        return torch.full((rows,), (tokens - 1) % shape.block + 1, device=device, dtype=torch.int32)

    try:
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        decode.plan(indptr(case.full_tables), case.full_tables.flatten(), last_len(shape.suffix, n),
                    shape.hq, shape.hkv, shape.head_dim, shape.block, q_data_type=case.q.dtype)
        found["flashinfer_decode"] = lambda: decode.run(case.q, cache)
    except Exception as exc:  # noqa: BLE001 - report and keep benchmarking the rest
        print(f"flashinfer decode skipped: {exc!r}")
    try:
        casc = flashinfer.MultiLevelCascadeAttentionWrapper(2, torch.empty_like(workspace), "NHD")
        qo = [torch.tensor([0, n], device=device, dtype=torch.int32),
              torch.arange(n + 1, device=device, dtype=torch.int32)]
        casc.plan(qo, [indptr(case.prefix_table), indptr(case.suffix_tables)],
                  [case.prefix_table.flatten(), case.suffix_tables.flatten()],
                  [last_len(shape.prefix, 1), last_len(shape.suffix, n)],
                  shape.hq, shape.hkv, shape.head_dim, shape.block)
        found["flashinfer_cascade"] = lambda: casc.run(case.q, cache)
    except Exception as exc:  # noqa: BLE001
        print(f"flashinfer cascade skipped: {exc!r}")
    return found


def bench_shape(shape: Shape, dtype: torch.dtype, device: torch.device, copy_bw: float) -> dict[str, Any]:
    layer = 1
    case = make_case(shape, dtype, device)
    level = SharedLevel(case.prefix_table, torch.tensor([shape.prefix], device=device),
                        torch.zeros(shape.n, dtype=torch.int32, device=device))
    plan = plan_cascade(case.pool, shape.hq, [level], case.suffix_tables,
                        torch.full((shape.n,), shape.suffix, device=device, dtype=torch.int32))
    max_len = int(case.seq_lens[0])
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "gather_sdpa": gather_sdpa(case, shape, layer),
        "plain": lambda: paged_decode_attention(case.q, case.pool, layer, case.full_tables, case.seq_lens,
                                                max_kv_len=max_len).out,
        "cascade": lambda: cascade_attention(case.q, case.pool, layer, plan).out,
    }
    candidates.update(flashinfer_candidates(case, shape, layer))

    elem = case.q.element_size()
    per_token = 2 * shape.hkv * shape.head_dim * elem
    q_and_out = 2 * shape.n * shape.hq * shape.head_dim * elem
    floor_bytes = (shape.prefix + shape.n * shape.suffix) * per_token + q_and_out
    plain_bytes = shape.n * (shape.prefix + shape.suffix) * per_token + q_and_out
    model = estimate_decode(
        num_requests=shape.n, context_tokens=shape.n * (shape.prefix + shape.suffix),
        duplicate_tokens=(shape.n - 1) * shape.prefix, longest_context=shape.prefix + shape.suffix,
        prefix_parts=plan.levels[0].num_splits, suffix_parts=plan.suffix_splits, num_levels=1,
        num_q_heads=shape.hq, num_kv_heads=shape.hkv, head_dim=shape.head_dim, dtype_bytes=elem,
        model=CostModel(),
    )
    reference = candidates["plain"]().float()
    results: dict[str, Any] = {}
    for name, fn in candidates.items():
        try:
            diff = float((fn().float() - reference).abs().max())
            us = timed(fn, device)
        except torch.cuda.OutOfMemoryError:
            results[name] = {"skipped": "out of memory"}
            torch.cuda.empty_cache()
            continue
        algo_bytes = model.cascade_bytes if "cascade" in name else plain_bytes
        results[name] = {
            "us": round(us, 2),
            "us_graph": graph_time(fn, device),
            "eff_bw_frac": round(algo_bytes / (us * 1e-6) / copy_bw, 3),
            "floor_frac": round(floor_bytes / copy_bw / (us * 1e-6), 3),
            "max_abs_diff_vs_plain": diff,
        }
    rule = should_use_cascade(shape.n, shape.prefix, shape.hq, shape.hkv, suffix_len=shape.suffix,
                              head_dim=shape.head_dim, dtype_bytes=elem)
    key = "us_graph" if results["cascade"].get("us_graph") and results["plain"].get("us_graph") else "us"
    faster = "cascade" if results["cascade"][key] < results["plain"][key] else "plain"
    return {"shape": shape._asdict(), "candidates": results, "floor_bytes": floor_bytes,
            "rule": "cascade" if rule else "plain", "measured_faster": faster,
            "model_us": {"plain": round(model.plain_s * 1e6, 2), "cascade": round(model.cascade_s * 1e6, 2)}}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'shape':<10}{'N':>5}{'P':>7}{'S':>6} {'candidate':<20}{'us':>10}{'graph us':>10}"
          f"{'eff_bw':>8}{'floor':>7}{'diff':>10}")
    for row in rows:
        s = row["shape"]
        for name, r in row["candidates"].items():
            head = f"{s['name']:<10}{s['n']:>5}{s['prefix']:>7}{s['suffix']:>6} {name:<20}"
            if "skipped" in r:
                print(f"{head}skipped: {r['skipped']}")
                continue
            graph = f"{r['us_graph']:>10.1f}" if r["us_graph"] is not None else f"{'-':>10}"
            print(f"{head}{r['us']:>10.1f}{graph}{r['eff_bw_frac']:>8.2f}{r['floor_frac']:>7.2f}"
                  f"{r['max_abs_diff_vs_plain']:>10.2e}")
        print(f"{'':<10}rule: {row['rule']}  measured faster: {row['measured_faster']}  model us: {row['model_us']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, runs on CPU under the interpreter")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (A,B,C,P256,...,N128)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("the full benchmark needs a GPU; use --smoke on CPU")
    shapes = smoke_shapes() if args.smoke else full_shapes()
    if args.shapes:
        wanted = set(args.shapes.split(","))
        shapes = [s for s in shapes if s.name in wanted]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device)
    rows = [bench_shape(shape, dtype, device, copy_bw) for shape in shapes]
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}; "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print_table(rows)
    if args.json:
        print(json.dumps({"device": str(device), "dtype": str(dtype), "copy_bw_Bps": copy_bw, "results": rows}))


if __name__ == "__main__":
    main()
