"""vLLM with and without tierkv, the way a user would choose between them.

Runs in the vLLM venv (``bash scripts/ci_vllm.sh`` builds one; vLLM 0.32.0, CPU build). One
random-init Llama (default 8 layers, hidden 512, 8 heads, 2 KV heads: head_dim 64, bf16)
saved with a locally trained tokenizer; single-process engines (``uni`` executor, in this
process). The configurations, each a fresh engine on the same prompts:

* ``vllm``: vLLM alone, prefix caching off; ``vllm_apc``: vLLM alone, prefix caching on;
* ``tierkv_embedded``: the TierKVConnector with its own home (prefix caching on: tierkv adds
  to vLLM's cache, it does not replace it); ``tierkv_daemon``: the connector talking to a
  ``tierkv serve`` started by this script;
* ``offloading`` / ``simple_cpu_offload``: vLLM's own ``OffloadingConnector`` and
  ``SimpleCPUOffloadConnector``, wherever they start (on a CPU-only machine they refuse: the
  refusal text is recorded).

Scenarios, interleaved round by round (every configuration once per round, so load from
other processes on a shared machine spreads over all of them; vLLM with prefix caching runs
before the tierkv engines in odd-numbered rounds and after them in even-numbered ones, so a
machine whose speed drifts favours neither side):

1. no reuse: ``--throughput-prompts`` distinct ``--throughput-tokens``-token prompts in one
   ``generate`` (greedy, 4 new tokens); prompts/s;
2. hit in the same engine: a ``--prompt-tokens`` prompt seen once, then timed
   ``--hit-repeats`` times (TTFT = wall time of ``generate(max_tokens=1)``; the engine's
   median is the round's figure: one request of ~15 ms varied by 20-50% from one to the
   next on a shared 2-core machine);
3. hit after an engine restart: a fresh engine on the same store (embedded: its segments
   dropped from the page cache, so the pages come from disk: read back by the store's warm
   start while the engine starts, ``loads.tierkv_embedded_engine_restart_warmed_blocks``
   and ``_warm_ms``, or by the request where the warm start has not read them; daemon: kept
   running, so they come from its memory tiers);
4. hit after a daemon restart too: the daemon restarted (SIGTERM: its warm start reads back
   what its device tier held), its segments dropped from the page cache.

Every timed request's greedy first token and top-5 logprobs, and the no-reuse workload's
generated tokens, are compared with vLLM alone (prefix caching off). Reported: medians per
scenario and medians of the per-round ratios (paired in the same round). The last line
printed with ``--json`` is one JSON object.

    /path/to/vllm-venv/bin/python scripts/bench_vllm.py --block-size 32 --json
    /path/to/vllm-venv/bin/python scripts/bench_vllm.py --small --json     # a quick check
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(out: Path, args: argparse.Namespace) -> Path:
    from tierkv.quickstart import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, intermediate_size=2 * args.hidden, vocab_size=2048,
                         context=max(4096, 2 * args.prompt_tokens))
    texts = [f"line {i} of a corpus for the benchmark tokenizer: store block page tier lease\n" for i in range(400)]
    return build_tiny_model(out, texts, spec)


class Engine:
    """One vLLM engine in this process, closed with ``close()`` (connector shutdown included)."""

    def __init__(self, model: Path, args: argparse.Namespace, *, apc: bool, connector: dict | None = None) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw: dict[str, Any] = {}
        if connector is not None:
            kw["kv_transfer_config"] = KVTransferConfig(kv_role="kv_both", **connector)
        t0 = time.perf_counter()
        self.llm = LLM(model=str(model), enforce_eager=True, distributed_executor_backend="uni",
                       block_size=args.block_size, dtype=args.dtype, max_model_len=args.max_len, seed=0,
                       enable_prefix_caching=apc, max_num_batched_tokens=args.max_len, **kw)
        self.start_s = time.perf_counter() - t0

    def warm_up(self, prompt: list[int]) -> None:
        """A short prefill and a few decode steps: every kernel shape a timed request uses
        (one-token forwards included) is prepared before anything is timed."""
        from vllm import SamplingParams

        self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)

    def first_token(self, prompt: list[int]) -> tuple[float, int, dict[int, float]]:
        """(TTFT, greedy first token, its top-5 logprobs)."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, logprobs=5),
                                use_tqdm=False)
        ttft = time.perf_counter() - t0
        o = out[0].outputs[0]
        return ttft, o.token_ids[0], {k: v.logprob for k, v in o.logprobs[0].items()}

    def batch(self, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        """(seconds, greedy tokens per prompt) for one generate() of all prompts."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, temperature=0),
                                 use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    def connector_stats(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().stats()

    def close(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()


class Daemon:
    """``tierkv serve`` in a child process, on a home and socket of its own."""

    def __init__(self, work: Path, args: argparse.Namespace, layout: str) -> None:
        self.home, self.run = work / "daemon-home", work / "daemon-run"
        self.run.mkdir(mode=0o700, exist_ok=True)
        self.sock = self.run / "tierkv.sock"
        self.args, self.layout = args, layout
        self.proc: subprocess.Popen | None = None
        self.log = work / "daemon.log"

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tierkv.cli import main; main()", "serve", "--home", str(self.home),
                 "--socket", str(self.sock), "--layout", self.layout, "--device", "cpu",
                 "--device-bytes", str(self.args.device_bytes), "--host-bytes", str(self.args.host_bytes),
                 "--disk-bytes", str(self.args.disk_bytes)],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tierkv serve did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
            self.proc = None

    def segments(self) -> list[Path]:
        return [p for p in self.home.rglob("*") if p.is_file() and "segments" in p.parts]


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(abs(a[k] - b[k]) for k in a)


def refusal(model: Path, args: argparse.Namespace, name: str) -> str | None:
    """None when vLLM's own connector ``name`` starts here, else why it refused."""
    try:
        eng = Engine(model, args, apc=True, connector={"kv_connector": name,
                                                       "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}})
    except Exception as e:  # the refusal is the result
        # A half-built engine leaves its connector and process group behind: clear them, or
        # the next engine of this process registers its KV caches with that connector.
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        try:
            kv_transfer_state.ensure_kv_transfer_shutdown()
        except Exception:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        gc.collect()
        cleanup_dist_env_and_memory()
        return f"{type(e).__name__}: {str(e).strip()[:400]}"
    eng.close()
    return None


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's (and tierkv's) block size; CPU: a multiple of 32")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="the reused prompt (one token is added: vLLM "
                    "computes the last token itself, so every block of the prefix can come from a cache)")
    ap.add_argument("--throughput-prompts", type=int, default=16)
    ap.add_argument("--throughput-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hit-repeats", type=int, default=5,
                    help="timed same-engine hits per engine (their median is the round's figure)")
    ap.add_argument("--throughput-configs", default="vllm,vllm_apc,tierkv_embedded,tierkv_daemon",
                    help="configurations that run the no-reuse workload (it is the longest part)")
    ap.add_argument("--skip", default="", help="comma-separated configurations to leave out "
                    "(vllm_apc,tierkv_embedded,tierkv_daemon,native,throughput)")
    ap.add_argument("--small", action="store_true", help="4 layers, 1,024-token prompt, 4 x 512 no-reuse, 1 round")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.small:
        args.layers, args.prompt_tokens, args.rounds = 4, 1024, 1
        args.throughput_prompts, args.throughput_tokens = 4, 512
    skip = set(filter(None, args.skip.split(",")))
    throughput_configs = set(filter(None, args.throughput_configs.split(",")))
    args.device_bytes, args.host_bytes, args.disk_bytes = 256 << 20, 512 << 20, 4 << 30
    args.max_len = max(args.prompt_tokens + 1, args.throughput_tokens) + 64

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tierkv-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    os.chdir(work)  # vLLM's `python -m` helper subprocess must not see a tierkv checkout's kernels/
    from tierkv.tiers.diskio import drop_page_cache

    model = build_model(work / "model", args)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens + 1)]
    warm = [rng.randrange(3, vocab) for _ in range(64)]
    head_dim = args.hidden // args.heads
    layout = (f"num_layers={args.layers},num_kv_heads={args.kv_heads},head_dim={head_dim},"
              f"block_size={args.block_size},dtype={args.dtype}")
    embedded = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"home": str(work / "home"), "device_bytes": args.device_bytes,
                                              "host_bytes": args.host_bytes, "disk_bytes": args.disk_bytes}}
    daemon = Daemon(work, args, layout)
    via_daemon = {**embedded, "kv_connector_extra_config": {"socket": str(daemon.sock), "timeout_s": 30}}

    native: dict[str, str | None] = {}
    if "native" not in skip:
        for key, name in (("offloading", "OffloadingConnector"), ("simple_cpu_offload", "SimpleCPUOffloadConnector")):
            native[key] = refusal(model, args, name)
            log(f"{name}: {'starts' if native[key] is None else 'refused: ' + str(native[key])[:200]}")

    ttft: dict[str, list[float]] = {}
    tput: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}  # what the worker side spent loading, per restart hit
    diffs: dict[str, float] = {}
    mismatches: list[str] = []
    saves: dict[str, Any] = {}
    ref: dict[str, Any] = {}

    def add(d: dict[str, list[float]], key: str, value: float) -> None:
        d.setdefault(key, []).append(value)

    def check(name: str, token: int, lp: dict[int, float]) -> None:
        if token != ref["token"]:
            mismatches.append(f"{name}: first token {token} != {ref['token']}")
        diffs[name] = max(diffs.get(name, 0.0), max_diff(lp, ref["logprobs"]))

    def timed(name: str, eng: Engine, p: list[int], repeats: int = 1) -> float:
        times = []
        for _ in range(repeats):
            t, token, lp = eng.first_token(p)
            check(name, token, lp)
            times.append(t)
        t = statistics.median(times)  # unrounded: median() rounds to 0.1 ms, ~1% of a hit
        add(ttft, name, t)
        return t

    def no_reuse(name: str, eng: Engine, prompts: list[list[int]]) -> None:
        if "throughput" in skip or name not in throughput_configs:
            return
        secs, outs = eng.batch(prompts)
        add(tput, name, len(prompts) / secs)
        # The first configuration measured in a round (vLLM alone) is the reference for that
        # round's prompts (each round draws new ones).
        if ref.get("batch_round") != rnd:
            ref["batch"], ref["batch_round"], ref["batch_name"] = outs, rnd, name
        elif outs != ref["batch"]:
            mismatches.append(f"round {rnd + 1}: {name}: no-reuse outputs differ from {ref['batch_name']}")

    if "tierkv_daemon" not in skip:
        daemon.start()
    try:
        for rnd in range(args.rounds):
            log(f"round {rnd + 1}/{args.rounds} ...")
            prompts = [[rng.randrange(3, vocab) for _ in range(args.throughput_tokens)]
                       for _ in range(args.throughput_prompts)]
            eng = Engine(model, args, apc=False)
            eng.warm_up(warm)
            no_reuse("vllm", eng, prompts)
            t, token, lp = eng.first_token(prompt)
            ref.setdefault("token", token)
            ref.setdefault("logprobs", lp)
            check("recompute", token, lp)
            add(ttft, "recompute", t)
            eng.close()

            def run_apc() -> float | None:
                if "vllm_apc" in skip:
                    return None
                eng = Engine(model, args, apc=True)
                eng.warm_up(warm)
                no_reuse("vllm_apc", eng, prompts)
                eng.first_token(prompt)
                t = timed("vllm_apc_hit", eng, prompt, args.hit_repeats)
                eng.close()
                return t

            # vLLM's own hit before the tierkv engines in rounds 1, 3, ... and after them in 2, 4, ...:
            # the machine's speed drifts over minutes, and a fixed order would favour one side.
            apc = run_apc() if rnd % 2 == 0 else None
            hits: dict[str, float] = {}
            for name, connector in (("tierkv_embedded", embedded), ("tierkv_daemon", via_daemon)):
                if name in skip:
                    continue
                eng = Engine(model, args, apc=True, connector=connector)
                eng.warm_up(warm)
                no_reuse(name, eng, prompts)
                eng.first_token(prompt)  # stores it (or finds it stored by an earlier round)
                hits[f"{name}_same_engine_hit"] = timed(f"{name}_same_engine_hit", eng, prompt, args.hit_repeats)
                s = eng.connector_stats()
                saves[name] = {k: s.get(k) for k in ("saved_tokens", "save_failures", "save_dropped_blocks")}
                eng.close()
                if name == "tierkv_embedded":
                    drop_page_cache([p for p in (work / "home").rglob("*") if p.is_file() and "segments" in p.parts])
                eng = Engine(model, args, apc=True, connector=connector)
                eng.warm_up(warm)
                before = eng.connector_stats()
                hits[f"{name}_engine_restart_hit"] = timed(f"{name}_engine_restart_hit", eng, prompt)
                after = eng.connector_stats()
                add(loads, f"{name}_engine_restart_load_ms", 1000 * (after["load_seconds"] - before["load_seconds"]))
                add(loads, f"{name}_engine_restart_loaded_tokens", after["loaded_tokens"] - before["loaded_tokens"])
                warm_start = before.get("store", {}).get("warm_start")  # embedded: what its open read back
                if warm_start is not None:
                    add(loads, f"{name}_engine_restart_warmed_blocks", warm_start["warmed_blocks"])
                    add(loads, f"{name}_engine_restart_warm_ms", 1000 * warm_start["seconds"])
                eng.close()
                if name == "tierkv_daemon":
                    daemon.stop()
                    drop_page_cache(daemon.segments())
                    daemon.start()
                    eng = Engine(model, args, apc=True, connector=connector)
                    eng.warm_up(warm)
                    hits["tierkv_daemon_restart_hit"] = timed("tierkv_daemon_restart_hit", eng, prompt)
                    eng.close()
            if rnd % 2:
                apc = run_apc()
            for key, t in hits.items():
                if apc is not None:
                    add(ratios, f"{key}_vs_vllm_apc_hit", t / apc)
                if key.endswith("_engine_restart_hit"):
                    add(ratios, f"{key}_vs_recompute", t / ttft["recompute"][-1])
            for name in ("tierkv_embedded", "tierkv_daemon", "vllm_apc"):
                if name in tput and "vllm" in tput:
                    add(ratios, f"{name}_no_reuse_throughput_vs_vllm", tput[name][-1] / tput["vllm"][-1])
                if name != "vllm_apc" and name in tput and "vllm_apc" in tput:  # same prefix-caching setting
                    add(ratios, f"{name}_no_reuse_throughput_vs_vllm_apc", tput[name][-1] / tput["vllm_apc"][-1])
    finally:
        daemon.stop()

    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "dtype": args.dtype},
        "block_size": args.block_size, "prompt_tokens": len(prompt), "rounds": args.rounds,
        "hit_repeats": args.hit_repeats,
        "no_reuse": {"prompts": args.throughput_prompts, "tokens": args.throughput_tokens},
        "ttft_s": {k: median(v) for k, v in ttft.items()},
        "no_reuse_prompts_per_s": {k: median(v) for k, v in tput.items()},
        "paired_ratio_medians": {k: median(v) for k, v in ratios.items()},
        "paired_ratios": {k: [round(x, 4) for x in v] for k, v in ratios.items()},
        "loads": {k: median(v) for k, v in loads.items()},
        "native_connectors": {k: ("started" if v is None else f"refused: {v}") for k, v in native.items()},
        "saves_last_round": saves,
        "logprob_max_abs_diff": {k: round(v, 6) for k, v in diffs.items()},
        "output_mismatches": mismatches,
    }
    for k, v in result["ttft_s"].items():
        print(f"{k:<42} {1000 * v:>10.1f} ms")
    for k, v in result["no_reuse_prompts_per_s"].items():
        print(f"{k + ' no reuse':<42} {v:>10.3f} prompts/s")
    for k, v in result["paired_ratio_medians"].items():
        print(f"{k:<58} {v:.3f}")
    print(f"output mismatches: {mismatches or 'none'}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
