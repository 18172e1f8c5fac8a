"""Time to first token in vLLM: recompute vs vLLM's own prefix cache vs tierkv's connector.

Runs in the vLLM venv (``bash scripts/ci_vllm.sh`` builds one; vLLM 0.32.0, CPU build). One
random-init Llama (default 8 layers, hidden 512, 8 heads, 2 KV heads: head_dim 64) saved with
a locally trained tokenizer, a ``--prompt-tokens`` prompt, single-process CPU engines:

1. recompute: vLLM alone, prefix caching off; the prompt is prefilled from nothing;
2. vllm_apc_hit: vLLM alone with automatic prefix caching, the prompt seen before (its
   blocks are in vLLM's own KV cache);
3. tierkv_host: the TierKVConnector (embedded home), prefix caching off, the prompt stored
   by an earlier request of the same engine (pages in tierkv's memory tiers);
4. tierkv_disk: a fresh engine on the same home after a restart (memory tiers empty,
   segments dropped from the page cache): pages are read from disk and checksummed.

TTFT is the wall time of ``generate(max_tokens=1)`` for one request, median over ``--runs``
(tierkv_disk: one sample per restart). ``logprob_max_abs_diff`` compares the first token's
top-5 logprobs of every tierkv run with recompute.

    /path/to/vllm-venv/bin/python scripts/bench_vllm.py --json
    /path/to/vllm-venv/bin/python scripts/bench_vllm.py --small --json

The last line printed with ``--json`` is one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 32  # the CPU attention backend needs a multiple of 32




def build_model(out: Path, args: argparse.Namespace) -> Path:
    from tierkv.quickstart import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, intermediate_size=2 * args.hidden, vocab_size=2048,
                         context=max(4096, 2 * args.prompt_tokens))
    texts = [f"line {i} of a corpus for the benchmark tokenizer: store block page tier lease\n" for i in range(400)]
    return build_tiny_model(out, texts, spec)


class Engine:
    """One vLLM engine in this process, closed with ``close()`` (connector shutdown included)."""

    def __init__(self, model: Path, *, apc: bool, home: Path | None, max_len: int) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw: dict[str, Any] = {}
        if home is not None:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"home": str(home), "device_bytes": 256 << 20, "host_bytes": 256 << 20,
                                           "disk_bytes": 1 << 30})
        self.llm = LLM(model=str(model), enforce_eager=True, distributed_executor_backend="uni", block_size=BLOCK,
                       dtype="float32", max_model_len=max_len, seed=0, enable_prefix_caching=apc, **kw)

    def first_token(self, prompt: list[int]) -> tuple[float, dict[int, float]]:
        from vllm import SamplingParams

        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, logprobs=5),
                                use_tqdm=False)
        ttft = time.perf_counter() - t0
        return ttft, {k: v.logprob for k, v in out[0].outputs[0].logprobs[0].items()}

    def connector_stats(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().stats()

    def close(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(abs(a[k] - b[k]) for k in a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a quick run (4 layers, 512 tokens, 2 runs)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.small:
        args.layers, args.prompt_tokens, args.runs = 4, 512, 2

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tierkv-bench-vllm-"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    os.chdir(work)  # vLLM's `python -m` helper subprocess must not see a tierkv checkout's kernels/
    model = build_model(work / "model", args)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    # The prompt ends one token past a block boundary so every block of the prefix can come
    # from a cache (vLLM always computes the last token).
    n = args.prompt_tokens // BLOCK * BLOCK + 1
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    warm = [rng.randrange(3, vocab) for _ in range(64)]
    max_len = n + 64
    home = work / "home"
    ttft: dict[str, float] = {}
    diffs: list[float] = []

    eng = Engine(model, apc=False, home=None, max_len=max_len)
    eng.first_token(warm)
    samples, ref = [], None
    for _ in range(args.runs):
        t, lp = eng.first_token(prompt)
        samples.append(t)
        ref = ref or lp
    ttft["recompute"] = statistics.median(samples)
    eng.close()
    assert ref is not None

    eng = Engine(model, apc=True, home=None, max_len=max_len)
    eng.first_token(warm)
    eng.first_token(prompt)
    ttft["vllm_apc_hit"] = statistics.median(eng.first_token(prompt)[0] for _ in range(args.runs))
    eng.close()

    eng = Engine(model, apc=False, home=home, max_len=max_len)
    eng.first_token(warm)
    eng.first_token(prompt)  # stores the prefix
    samples = []
    for _ in range(args.runs):
        t, lp = eng.first_token(prompt)
        samples.append(t)
        diffs.append(max_diff(lp, ref))
    ttft["tierkv_host"] = statistics.median(samples)
    eng.close()

    from tierkv.tiers.diskio import drop_page_cache

    samples, load_ms = [], []
    loaded = 0
    for _ in range(args.runs):
        drop_page_cache([p for p in (home / "segments").rglob("*") if p.is_file()])
        eng = Engine(model, apc=False, home=home, max_len=max_len)
        eng.first_token(warm)
        before = eng.connector_stats()
        t, lp = eng.first_token(prompt)
        after = eng.connector_stats()
        samples.append(t)
        diffs.append(max_diff(lp, ref))
        loaded = int(after["loaded_tokens"] - before["loaded_tokens"])
        load_ms.append(1000 * (after["load_seconds"] - before["load_seconds"]))
        eng.close()
    ttft["tierkv_disk"] = statistics.median(samples)

    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads},
        "prompt_tokens": n, "block_size": BLOCK, "runs": args.runs,
        "ttft_s": {k: round(v, 4) for k, v in ttft.items()},
        "tierkv_disk_loaded_tokens": loaded,
        "tierkv_disk_load_ms": round(statistics.median(load_ms), 2),
        "ttft_ratio_tierkv_disk_vs_recompute": round(ttft["tierkv_disk"] / ttft["recompute"], 4),
        "ttft_ratio_tierkv_disk_vs_vllm_apc_hit": round(ttft["tierkv_disk"] / ttft["vllm_apc_hit"], 4),
        "ttft_ratio_tierkv_host_vs_recompute": round(ttft["tierkv_host"] / ttft["recompute"], 4),
        "logprob_max_abs_diff": max(diffs),
    }
    print(f"{'scenario':<14} {'ttft ms':>10}")
    for k, v in ttft.items():
        print(f"{k:<14} {1000 * v:>10.1f}")
    print(f"tierkv disk / recompute: {result['ttft_ratio_tierkv_disk_vs_recompute']:.3f}   "
          f"tierkv disk / vLLM APC hit: {result['ttft_ratio_tierkv_disk_vs_vllm_apc_hit']:.3f}   "
          f"logprob max |diff|: {result['logprob_max_abs_diff']:.2e}   "
          f"disk load: {loaded} tokens in {result['tierkv_disk_load_ms']:.1f} ms")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
