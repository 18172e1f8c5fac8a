"""Time to first token of a long shared prefix: recompute vs tierkv vs saving the cache by hand.

One random-init Llama (default: ~135M parameters, 30 layers, hidden 576, 9 heads, 3 KV heads,
SmolLM-like), a 4,096-token prefix and a 64-token question, side by side in one run:

1. recompute: prefill prefix + question from nothing;
2. tierkv, disk tier, cold: the store is closed and reopened (memory tiers empty) and the
   segment files are dropped from the page cache (posix_fadvise DONTNEED; the store also
   reads with O_DIRECT where the file system allows), then restore + question prefill;
3. tierkv, memory tiers: the same request again, pages already promoted (on a CPU-only machine
   the device tier is host RAM, so this is the host-memory restore);
4. torch.save / torch.load of the per-layer (K, V) tensors (file dropped from the page cache);
5. safetensors save_file / load_file of the same tensors (file dropped from the page cache);
6. with ``--page-codec int8`` (the default compares both), the same disk-tier restore and TTFT
   from a second home whose host and disk tiers hold int8 pages (tierkv/codec.py), reported
   as ``*_int8`` beside the exact figures: restore time, TTFT, the logits' max abs diff
   against recomputation, greedy-token agreement over ``--gen-tokens`` generated tokens, and
   the bytes on disk.

"restore" is lookup + read + copy into a transformers DynamicCache, on a store already open
(a server opens its store once); ``open_store_s`` is ``tierkv.open`` of the cold home, reported
separately, and ``restore_disk_with_open_s`` is both, comparable to the file baselines, whose
times include opening their file. "ttft" adds the question's prefill and choosing the first
token (on a freshly opened store, open not included). Ratios are tierkv / recompute (lower is better); speedups
are other / tierkv-disk restore (higher is better). Medians over ``--runs``.

    python scripts/bench_ttft.py --json            # full size (minutes on a few CPU cores)
    python scripts/bench_ttft.py --small --json    # a quick run

The last line printed with ``--json`` is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.prefix + args.question_tokens + args.gen_tokens + 64),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    previous = torch.get_default_dtype()
    # Built on its device in its dtype: an 8B model made in fp32 on the CPU first would take
    # 32 GB of host memory and minutes of initialisation.
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def sync(device: str) -> None:
    """Wait for the GPU's queued work, so that a timer read after it counts that work."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="4 layers, hidden 256, 1,024-token prefix")
    ap.add_argument("--llama8b", action="store_true",
                    help="a random-init model of Llama-3-8B's shape (32 layers, hidden 4096, 8 KV heads of 128, "
                         "vocab 128,256) and an 8,192-token prefix: for a GPU (16 GB of bf16 weights)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="weights and KV dtype (float32 by default; bfloat16 with --llama8b)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--populate-memory", action="store_true",
                    help="fault the memory tiers in behind each open (StoreConfig.populate_memory; off by default)")
    ap.add_argument("--prefix-tokens", type=int, default=None)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--home", type=Path, default=None, help="store home (default: a temporary directory)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--page-codec", choices=("none", "int8"), default="int8",
                    help="also measure a home with this page codec beside the exact one (none: skip)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens compared against recomputation")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if args.llama8b else "float32")
    if args.llama8b:
        shape = dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, prefix=8192)
    elif args.small:
        shape = dict(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=704, vocab=8192, prefix=1024)
    else:
        shape = dict(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, prefix=4096)
    for k, v in shape.items():
        setattr(args, k, v)
    args.prefix = args.prefix_tokens or args.prefix

    import tierkv
    from safetensors.torch import load_file, save_file

    from tierkv.hf import cache_from_kv, cached_prefill, generate, layout_from_model, lease_kv, restore_cache
    from tierkv.identity import Scope
    from tierkv.model_version import model_version_from_parts
    from tierkv.tiers.diskio import drop_page_cache

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    layout = layout_from_model(model, 16)
    scope = Scope(model_version_from_parts(weights="bench_ttft:random-seed-0", config=[json.dumps(model.config.to_dict(),
                  sort_keys=True, default=str)], tokenizer=[], layout=layout))
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, args.vocab, (args.prefix,), generator=g).tolist()
    tokens = prefix + torch.randint(0, args.vocab, (args.question_tokens,), generator=g).tolist()
    tmp = tempfile.TemporaryDirectory(prefix="bench-ttft-")
    work = Path(tmp.name)
    home = args.home or work / "home"
    store_opts = dict(device_bytes=layout.page_bytes * (len(tokens) // 16 + 8),
                      host_bytes=max(1 << 30, layout.slot_bytes * (len(tokens) // 16 + 8)),
                      disk_bytes=max(1 << 30, 2 * layout.slot_bytes * (len(tokens) // 16 + 8)),
                      populate_memory=args.populate_memory)
    log(f"model: {params / 1e6:.0f}M parameters, {args.layers} layers; prefix {args.prefix} + question "
        f"{args.question_tokens} tokens; page {layout.page_bytes} bytes; device {args.device}")

    with torch.inference_mode():
        model(torch.tensor([tokens[:16]], device=args.device))  # first-call overheads
    diffs: list[float] = []
    reference: list[torch.Tensor] = []  # logits of the first recompute run

    def recompute() -> float:
        r = generate(model, tokens, max_new_tokens=1)
        if reference:
            diffs.append((r.first_logits - reference[0]).abs().max().item())
        else:
            reference.append(r.first_logits)
        return r.ttft_s

    log("materialising the prefix into the store ...")
    with tierkv.open(home, layout, **store_opts) as store:
        t0 = time.perf_counter()
        cached_prefill(model, prefix, store=store, scope=scope, need_logits=False)
        materialize_s = time.perf_counter() - t0
        with store.acquire(prefix, scope) as lease:  # the baselines save the very KV the store serves
            layer_kv = [(k.cpu(), v.cpu()) for k, v in lease_kv(lease, layout)]
        disk_bytes_exact = store.stats()["tiers"]["disk"]["used_bytes"]
    segments = [p for p in sorted((home / "segments").glob("*")) if p.is_file()]
    codec = args.page_codec if args.page_codec != "none" else None
    home_c = work / f"home-{codec}"
    codec_opts = {**store_opts, "page_codec": codec}
    if codec:
        log(f"materialising the prefix into a {codec} home ...")
        with tierkv.open(home_c, layout, **codec_opts) as store:
            cached_prefill(model, prefix, store=store, scope=scope, need_logits=False)
            disk_bytes_codec = store.stats()["tiers"]["disk"]["used_bytes"]
            disk_slot_codec = store.disk.slot_bytes
    segments_c = [p for p in sorted(home_c.glob("segments/*")) if p.is_file()]
    pt, st = work / "cache.pt", work / "cache.safetensors"
    torch.save(layer_kv, pt)
    save_file({f"{kind}{i}": t for i, kv in enumerate(layer_kv) for kind, t in zip("kv", kv)}, str(st))
    del layer_kv

    def restore(store: Any) -> Any:
        # The path cached_prefill takes: windowed leases, reads overlapped with the copy.
        r = restore_cache(store, prefix, scope, len(prefix) // 16, model)
        assert r.tokens == len(prefix) // 16 * 16, r.tokens
        sync(args.device)
        return r.cache

    def cold_store() -> Any:
        drop_page_cache(segments)
        return tierkv.open(home, layout, **store_opts)

    def cold_codec_store() -> Any:
        drop_page_cache(segments_c)
        return tierkv.open(home_c, layout, **codec_opts)

    codec_diffs: list[float] = []

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def store_ttft(store: Any) -> float:
        r = generate(model, tokens, store=store, scope=scope, max_new_tokens=1, store_new=False)
        diffs.append((r.first_logits - reference[0]).abs().max().item())
        return r.ttft_s

    def load_pt() -> Any:
        cache = cache_from_kv(torch.load(pt, weights_only=True), model.device, model.dtype)
        sync(args.device)
        return cache

    def load_st() -> Any:
        d = load_file(str(st))
        cache = cache_from_kv([(d[f"k{i}"], d[f"v{i}"]) for i in range(args.layers)], model.device, model.dtype)
        sync(args.device)
        return cache

    def file_ttft(load: Callable[[], Any], path: Path) -> float:
        drop_page_cache([path])
        t0 = time.perf_counter()
        cache = load()
        with torch.inference_mode():
            out = model(torch.tensor([tokens[len(prefix):]], device=model.device), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        int(torch.argmax(logits))
        elapsed = time.perf_counter() - t0
        diffs.append((logits - reference[0]).abs().max().item())
        return elapsed

    # Round robin: every run measures every method once, so load from other processes on a
    # shared machine spreads over all of them instead of skewing one.
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    tiers: tuple[str, ...] = ()
    for run in range(args.runs):
        log(f"run {run + 1}/{args.runs} ...")
        add("ttft_recompute_s", recompute())  # first: run 0 sets the reference logits
        t0 = time.perf_counter()
        with cold_store() as store:
            add("open_store_s", time.perf_counter() - t0)
            t1 = time.perf_counter()
            restore(store)
            add("restore_disk_s", time.perf_counter() - t1)
            add("restore_disk_with_open_s", time.perf_counter() - t0)
        with cold_store() as store:
            add("ttft_disk_s", store_ttft(store))
        if codec:
            with cold_codec_store() as store:
                t1 = time.perf_counter()
                restore(store)
                add(f"restore_disk_{codec}_s", time.perf_counter() - t1)
            with cold_codec_store() as store:
                n_diffs = len(diffs)
                add(f"ttft_disk_{codec}_s", store_ttft(store))
                codec_diffs.extend(diffs[n_diffs:])  # not the exact paths' figure
                del diffs[n_diffs:]
        with tierkv.open(home, layout, **store_opts) as store:
            restore(store)  # a cold prefix's first restore reads it through (tierkv/core/read_through.py) ...
            restore(store)  # ... the second promotes it into the memory tiers
            tiers = store.lookup(prefix, scope).tiers
            add("restore_host_s", timed(lambda: restore(store)))
            add("ttft_host_s", store_ttft(store))
        drop_page_cache([pt])
        add("restore_torch_load_s", timed(load_pt))
        drop_page_cache([st])
        add("restore_safetensors_s", timed(load_st))
        add("ttft_torch_load_s", file_ttft(load_pt, pt))
        add("ttft_safetensors_s", file_ttft(load_st, st))
    agreement: dict[str, Any] = {}
    if args.gen_tokens:
        # Greedy tokens with the prefix restored from each home (cold), against recomputation.
        log(f"greedy agreement over {args.gen_tokens} tokens ...")
        ref = generate(model, tokens, max_new_tokens=args.gen_tokens).tokens
        homes = [("exact", cold_store)] + ([(codec, cold_codec_store)] if codec else [])
        for name, opener in homes:
            with opener() as store:
                got = generate(model, tokens, store=store, scope=scope, max_new_tokens=args.gen_tokens,
                               store_new=False, store_output=False).tokens
            same = sum(a == b for a, b in zip(ref, got))
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            agreement[f"greedy_agreement_{name}"] = same / max(1, len(ref))
            agreement[f"greedy_identical_prefix_{name}"] = first
    tmp.cleanup()
    med = {k: statistics.median(v) for k, v in samples.items()}
    if codec:
        agreement.update({
            f"logits_max_abs_diff_{codec}": max(codec_diffs), f"disk_used_bytes_{codec}": disk_bytes_codec,
            "disk_used_bytes_exact": disk_bytes_exact, f"disk_slot_bytes_{codec}": disk_slot_codec,
            "disk_slot_bytes_exact": layout.slot_bytes,
            f"restore_ratio_{codec}_vs_exact": med[f"restore_disk_{codec}_s"] / med["restore_disk_s"],
            f"ttft_ratio_{codec}_vs_exact": med[f"ttft_disk_{codec}_s"] / med["ttft_disk_s"],
        })

    result = {
        "model_params_m": round(params / 1e6, 1), "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
        "kv_heads": args.kv_heads, "prefix_tokens": args.prefix, "question_tokens": args.question_tokens,
        "runs": args.runs, "device": args.device, "dtype": args.dtype,
        "device_name": torch.cuda.get_device_name(0) if str(args.device).startswith("cuda") else "cpu", "torch_threads": torch.get_num_threads(),
        "kv_bytes": layout.page_bytes * (args.prefix // 16), "materialize_s": round(materialize_s, 3),
        "memory_tiers_hit": sorted(set(tiers)), **med,
        "ttft_ratio_disk_vs_recompute": med["ttft_disk_s"] / med["ttft_recompute_s"],
        "ttft_ratio_host_vs_recompute": med["ttft_host_s"] / med["ttft_recompute_s"],
        "restore_speedup_vs_torch_load": med["restore_torch_load_s"] / med["restore_disk_s"],
        "restore_speedup_vs_safetensors": med["restore_safetensors_s"] / med["restore_disk_s"],
        # The file baselines open their file inside their timing; a store is opened once per
        # serving process, so the speedups above leave its open out and these put it back.
        "restore_with_open_speedup_vs_torch_load": med["restore_torch_load_s"] / med["restore_disk_with_open_s"],
        "restore_with_open_speedup_vs_safetensors": med["restore_safetensors_s"] / med["restore_disk_with_open_s"],
        "logits_max_abs_diff": max(diffs),
        "reference_logits_max_abs": reference[0].abs().max().item(),
        "gen_tokens": args.gen_tokens, **agreement,
    }
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            print(f"{k:32} {v:.4g}" if isinstance(v, float) else f"{k:32} {v}")
    return result


if __name__ == "__main__":
    main()
