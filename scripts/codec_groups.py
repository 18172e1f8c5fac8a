"""Which scale groups for int8 pages: the error of each choice on a model's real KV.

Prefills ``--tokens`` random tokens through scripts/bench_ttft.py's model (random-init,
SmolLM-shaped) or a local model directory, cuts the KV into pages, and quantises them with
symmetric int8 under several scale groupings, each with power-of-two scales (what
tierkv/codec.py stores, for exact re-encoding) and with float ``absmax / 127`` scales:

- ``token``: one scale per (layer, K/V, token, head): ``head_dim`` values (tierkv's choice);
- ``head_block``: one per (layer, K/V, head) of a block: ``block_size x head_dim`` values;
- ``channel``: one per (layer, K/V, head, channel) of a block: ``block_size`` values.

Prints, per grouping, the relative RMS error of K and V, the largest error relative to the
largest |value| of its layer, and the scale bytes per page.

    python scripts/codec_groups.py --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def quantise(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """Round ``x`` [groups, n] to int8 with one scale per row."""
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    step = torch.exp2(torch.ceil(torch.log2(amax / 127))) if pow2 else amax / 127
    return torch.round(x / step).clamp(-127, 127) * step


def grouped(pages: torch.Tensor, how: str) -> tuple[torch.Tensor, callable]:
    """``pages`` [n, L, 2, B, H, D] as rows of one group each, and the inverse reshape."""
    n, L, two, B, H, D = pages.shape
    if how == "token":
        return pages.reshape(-1, D), lambda r: r.reshape(pages.shape)
    if how == "head_block":
        p = pages.permute(0, 1, 2, 4, 3, 5)  # [n, L, 2, H, B, D]
        return p.reshape(-1, B * D), lambda r: r.reshape(n, L, two, H, B, D).permute(0, 1, 2, 4, 3, 5)
    p = pages.permute(0, 1, 2, 4, 5, 3)  # channel: [n, L, 2, H, D, B]
    return p.reshape(-1, B), lambda r: r.reshape(n, L, two, H, D, B).permute(0, 1, 2, 5, 3, 4)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--model", type=Path, default=None, help="a local model directory (default: bench_ttft's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from tierkv.hf import layout_from_model
    from tierkv.layout import pack_pages

    if args.model is None:
        import bench_ttft

        shape = argparse.Namespace(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                                   device="cpu")
        model = bench_ttft.build_model(shape)
        vocab = shape.vocab
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
        vocab = model.config.vocab_size
    layout = layout_from_model(model, 16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, args.tokens), generator=g)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    cache = out.past_key_values
    layer_kv = [(cache.layers[i].keys, cache.layers[i].values) for i in range(layout.num_layers)]
    pages = pack_pages(layer_kv, layout, 0, args.tokens // 16).float()
    result: dict = {"tokens": args.tokens, "layout": layout.to_dict()}
    n_pages = pages.shape[0]
    for how in ("token", "head_block", "channel"):
        rows, back = grouped(pages, how)
        for pow2 in (True, False):
            y = back(quantise(rows, pow2))
            err = y - pages
            name = f"{how}_{'pow2' if pow2 else 'float'}"
            k_rel = (err[:, :, 0].norm() / pages[:, :, 0].norm()).item()
            v_rel = (err[:, :, 1].norm() / pages[:, :, 1].norm()).item()
            layer_amax = pages.abs().amax(dim=(0, 2, 3, 4, 5))
            worst = (err.abs().amax(dim=(0, 2, 3, 4, 5)) / layer_amax).max().item()
            result[name] = {"k_rel_rms": k_rel, "v_rel_rms": v_rel, "max_err_vs_layer_max": worst,
                            "scale_bytes_per_page": rows.shape[0] // n_pages}
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            print(f"{k:18} {v}")
    return result


if __name__ == "__main__":
    main()
