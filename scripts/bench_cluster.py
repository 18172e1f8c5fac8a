"""Cluster benchmark: one Mooncake master and two tierkv nodes on loopback.

1. remote fetch: node A publishes ``--blocks`` random pages; node B fetches and verifies
   them (batched get, header and page checksums) -> ``remote_fetch_gbps``; the same plus
   storing them into B's own tiers (durable put) -> ``remote_pull_gbps``;
2. local disk: the same pages restored from a cold disk tier (store reopened, segment files
   dropped from the page cache) into the device tier -> ``local_disk_gbps``;
3. TTFT (a small random-init Llama, ``--prefix-tokens`` + 64 question tokens): node A
   materialises and publishes the prefix; node B, which never saw it, answers the request
   pulling the prefix from the cluster -> ``ttft_ratio_cross_node_vs_recompute`` (lower is
   better), against recomputing everything.

Runs inside a private network namespace (``unshare -rn``, re-executing itself) so that no
listener or packet leaves loopback; ``--no-netns`` runs on the host's loopback instead (the
transfer engine then still listens on every interface). Medians over ``--runs``.

    python scripts/bench_cluster.py --json      # last line: one JSON object
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

NETNS_ENV = "TIERKV_BENCH_IN_NETNS"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def reexec_in_netns(argv: list[str]) -> int:
    cmd = " ".join(["ip link set lo up && exec", sys.executable, os.path.abspath(__file__), *map(_quote, argv)])
    env = {**os.environ, NETNS_ENV: "1"}
    return subprocess.call(["unshare", "-rn", "sh", "-c", cmd], env=env)


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)




def median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


def main(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="pages in the fetch benchmarks")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-ttft", action="store_true", help="skip the model part")
    ap.add_argument("--no-netns", action="store_true", help="run on the host's loopback, not in a namespace")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.no_netns and os.environ.get(NETNS_ENV) != "1":
        if not shutil.which("unshare"):
            raise SystemExit("unshare not found: pass --no-netns to run on the host's loopback")
        raise SystemExit(reexec_in_netns(argv))
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tierkv
    from tierkv import Priority, Scope
    from tierkv.checksum import page_checksum
    from tierkv.cluster import ClusterNode, PublishPolicy
    from tierkv.cluster.master import MasterProcess
    from tierkv.hf import generate, layout_from_model
    from tierkv.identity import block_keys
    from tierkv.model_version import model_version_from_parts
    from tierkv.tiers.diskio import drop_page_cache
    from tierkv.cluster.remote import RemoteConfig, RemoteMeta, RemoteTier

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    layout = layout_from_model(model, 16)
    scope = Scope(model_version_from_parts(weights="bench_cluster:random-seed-0", config=[cfg.to_json_string()],
                                           tokenizer=[], layout=layout))
    n_pages = max(args.blocks, args.prefix_tokens // 16 + 8)
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    seg = max(256 << 20, 3 * n_pages * (layout.page_bytes + 4096))
    store_opts = dict(device="cpu", device_bytes=layout.page_bytes * (n_pages + 8), host_bytes=0,
                      disk_bytes=2 * layout.slot_bytes * (n_pages + 8))
    out: dict[str, Any] = {"page_bytes": layout.page_bytes, "blocks": args.blocks, "transport": "tcp-loopback"}
    log(f"page {layout.page_bytes} bytes, {args.blocks} blocks; work dir {work}")

    master = MasterProcess(log_path=work / "master.log").start()

    def node(name: str) -> ClusterNode:
        config = RemoteConfig(master_address=master.address, metadata_url=master.metadata_url,
                              global_segment_bytes=seg, local_buffer_bytes=64 << 20, op_timeout_s=30.0)
        store = tierkv.open(work / name, layout, shm_dir=work / f"shm-{name}", **store_opts)
        return ClusterNode(store, RemoteTier(config, layout), PublishPolicy())

    a, b = node("a"), node("b")
    try:
        # 1. remote fetch
        g = torch.Generator().manual_seed(1)
        bw_scope = Scope(scope.model_version, "bench-bandwidth")
        tokens = torch.randint(0, 8192, (args.blocks * 16,), generator=g).tolist()
        pages = torch.randn((args.blocks, *layout.shape), generator=g).to(layout.torch_dtype)
        keys = block_keys(tokens, bw_scope, 16)
        tok = [torch.tensor(tokens[i * 16 : (i + 1) * 16], dtype=torch.int32).numpy().tobytes()
               for i in range(len(keys))]
        metas = [RemoteMeta(k, keys[i - 1] if i else bw_scope.seed, bw_scope.model_version, bw_scope.namespace,
                            tok[i], page_checksum(k, pages[i])) for i, k in enumerate(keys)]
        t0 = time.perf_counter()
        r = a.remote.put_pages(keys, pages, metas)
        out["remote_publish_gbps"] = round(args.blocks * layout.page_bytes / (time.perf_counter() - t0) / 1e9, 3)
        assert r.failed == 0, a.remote.stats()

        def fetch() -> float:
            t0 = time.perf_counter()
            got = b.remote.get_pages(keys, metas)
            dt = time.perf_counter() - t0
            assert len(got) == len(keys), b.remote.stats()
            return dt

        out["remote_fetch_gbps"] = round(args.blocks * layout.page_bytes / median_of(args.runs, fetch) / 1e9, 3)

        def pull() -> float:
            b.store.invalidate(namespace=bw_scope.namespace)
            t0 = time.perf_counter()
            res = b.pull(tokens, bw_scope)
            dt = time.perf_counter() - t0
            assert res.remote_blocks == args.blocks, res
            return dt

        out["remote_pull_gbps"] = round(args.blocks * layout.page_bytes / median_of(args.runs, pull) / 1e9, 3)
        log(f"remote: fetch {out['remote_fetch_gbps']} GB/s, pull {out['remote_pull_gbps']} GB/s")

        # 2. local disk, cold
        home = work / "c"
        with tierkv.open(home, layout, shm_dir=work / "shm-c", **store_opts) as c:
            c.put(tokens, pages, bw_scope, priority=Priority.NORMAL)

        def disk() -> float:
            drop_page_cache([p for p in (home / "segments").glob("*") if p.is_file()])
            with tierkv.open(home, layout, shm_dir=work / "shm-c", **store_opts) as c:
                t0 = time.perf_counter()
                with c.acquire(tokens, bw_scope) as lease:
                    dt = time.perf_counter() - t0
                    assert lease.num_blocks == args.blocks
            return dt

        out["local_disk_gbps"] = round(args.blocks * layout.page_bytes / median_of(args.runs, disk) / 1e9, 3)
        log(f"local disk (cold): {out['local_disk_gbps']} GB/s")

        # 3. TTFT across nodes
        if not args.no_ttft:
            prefix = torch.randint(0, 8192, (args.prefix_tokens,), generator=g).tolist()
            request = prefix + torch.randint(0, 8192, (64,), generator=g).tolist()
            with torch.inference_mode():
                model(torch.tensor([request[:16]]))
            reference = generate(model, request, max_new_tokens=1).tokens
            recompute = median_of(args.runs, lambda: generate(model, request, max_new_tokens=1).ttft_s)
            from tierkv.hf import cached_prefill

            cached_prefill(model, prefix, store=a, scope=scope, need_logits=False)
            published = a.publish_prefix(prefix, scope)
            log(f"prefix published: {published}")

            def cross() -> float:
                b.store.invalidate(model_version=scope.model_version)  # B has never seen it
                r = generate(model, request, store=b, scope=scope, max_new_tokens=1, store_new=False)
                assert r.tokens == reference, "cross-node restore changed the first token"
                return r.ttft_s

            cross_s = median_of(args.runs, cross)
            out.update(ttft_recompute_s=round(recompute, 4), ttft_cross_node_s=round(cross_s, 4),
                       ttft_ratio_cross_node_vs_recompute=round(cross_s / recompute, 3),
                       prefix_tokens=args.prefix_tokens)
            log(f"ttft: recompute {recompute:.3f} s, cross-node {cross_s:.3f} s")
        out["remote_stats_b"] = {k: v for k, v in b.remote.stats().items() if k in ("faults", "hits", "fetched_bytes")}
    finally:
        a.close()
        b.close()
        master.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    result = main(argv)
    if "--json" in argv:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in sorted(result.items()):
            print(f"{k:40} {v}")
