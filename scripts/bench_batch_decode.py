"""Batched shared-prefix decoding (``tierkv.hf.batch.generate_batch``) vs N separate generations.

One random-init Llama-style model (GQA), one cached prefix and N prompts that extend it:

1. batch: ``generate_batch`` - one lease on the prefix pages, read in place by the decode
   kernels for all N requests (prefix part: cascade or plain paged, per ``--cascade``);
2. separate: ``tierkv.hf.generate`` once per prompt with the same store - each request
   restores the prefix into its own DynamicCache (a copy per request), then decodes alone.

Both are greedy with the same token budget (no end-of-sequence stop), and the benchmark
checks they produce the same tokens. Reported: wall time, generated tokens/s, and the
memory held for the prefix: once under the lease vs one copy per concurrent request.

On a CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set here when
CUDA is absent), which costs far more per launch than the kernels' real work: CPU tokens/s
measure the interpreter, not the design. The memory figures hold on any device.

    python scripts/bench_batch_decode.py --json               # CPU-sized defaults
    python scripts/bench_batch_decode.py --device cuda --layers 16 --hidden 1024 --prefix 4096 --n 32 --json

The last line printed with ``--json`` is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tierkv.kernels is imported

# Run as a script, sys.path[0] is scripts/; the repository root must not be on it (its
# kernels/ directory shadows a package transformers probes for).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent.parent]


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prefix + args.suffix + args.new + 16, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    return LlamaForCausalLM(cfg).to(args.device, dtype).eval()


def timed(fn: Any, runs: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(runs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tierkv
    from tierkv.hf import generate, layout_from_model
    from tierkv.hf.batch import generate_batch
    from tierkv.identity import Scope

    model = build_model(args)
    layout = layout_from_model(model, args.block_size)
    scope = Scope(model_version="b" * 64)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(2, args.vocab, (args.prefix,), generator=gen).tolist()
    prompts = [prefix + torch.randint(2, args.vocab, (args.suffix,), generator=gen).tolist() for _ in range(args.n)]
    use_cascade = {"auto": None, "on": True, "off": False}[args.cascade]
    pool_bytes = 4 * (args.prefix // args.block_size + 1) * layout.page_bytes + (64 << 20)
    with tempfile.TemporaryDirectory() as home:
        store = tierkv.open(home, layout, device=args.device, device_bytes=pool_bytes, host_bytes=pool_bytes,
                            disk_bytes=4 * pool_bytes)
        try:
            def batch() -> Any:
                return generate_batch(model, prompts, store, prefix_tokens=prefix, scope=scope,
                                      max_new_tokens=args.new, eos_token_id=[], use_cascade=use_cascade)

            def separate() -> list[tuple[int, ...]]:
                return [generate(model, p, store=store, scope=scope, max_new_tokens=args.new, eos_token_id=[],
                                 store_new=False).tokens for p in prompts]

            batch()  # stores the prefix blocks; later runs find them cached
            batch_s, result = timed(batch, args.runs)
            separate_s, alone = timed(separate, args.runs)
        finally:
            store.close()
    generated = args.n * args.new
    # What a separate request holds for the prefix while it runs: its DynamicCache copy.
    per_copy = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * result.shared_tokens * \
        torch.empty((), dtype=layout.torch_dtype).element_size()
    return {
        "device": str(model.device), "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "n": args.n, "prefix": args.prefix, "suffix": args.suffix, "new": args.new, "block_size": args.block_size,
        "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": layout.head_dim,
        "dtype": args.dtype, "cascade": args.cascade,
        "batch_s": batch_s, "separate_s": separate_s,
        "batch_tok_s": generated / batch_s, "separate_tok_s": generated / separate_s,
        "speedup": separate_s / batch_s,
        "same_tokens": [list(t) for t in result.tokens] == [list(t) for t in alone],
        "shared_tokens": result.shared_tokens, "prefix_blocks": result.prefix_blocks,
        "cascade_steps": result.cascade_steps, "plain_steps": result.plain_steps,
        "prefix_bytes_held": result.prefix_bytes_held,
        "prefix_bytes_n_copies": args.n * per_copy,
        "per_request_suffix_bytes": list(result.per_request_suffix_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=256, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=8, help="own prompt tokens per request")
    parser.add_argument("--new", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--n", type=int, default=4, help="requests sharing the prefix")
    parser.add_argument("--cascade", default="on", choices=["auto", "on", "off"],
                        help="prefix kernel: cascade, plain paged, or the cost model's choice")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    res = run(args)
    mib = 1 << 20
    print(f"{res['n']} requests, prefix {res['prefix']} (shared {res['shared_tokens']}), suffix {res['suffix']}, "
          f"{res['new']} new tokens each, {res['device']}{' (Triton interpreter)' if res['interpreter'] else ''}")
    print(f"  batch     {res['batch_s']:8.3f} s  {res['batch_tok_s']:8.1f} tok/s  "
          f"(cascade steps {res['cascade_steps']}, plain {res['plain_steps']})")
    print(f"  separate  {res['separate_s']:8.3f} s  {res['separate_tok_s']:8.1f} tok/s  "
          f"same tokens: {res['same_tokens']}")
    print(f"  prefix memory: {res['prefix_bytes_held'] / mib:.3f} MiB held once vs "
          f"{res['prefix_bytes_n_copies'] / mib:.3f} MiB for {res['n']} copies; "
          f"suffix pages {sum(res['per_request_suffix_bytes']) / mib:.3f} MiB in all")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
