"""After an edit, how much of a repository prefix is computed again (issue #35)?

A real third-party tree (default: the installed ``click`` package, copied to a temporary
git work tree and committed once) is materialised as one named prefix with a small
random-init Llama whose tokenizer is trained on the tree. Then ``--trials`` times, one file
chosen at random (seeded; the same sequence for every way) gets a line appended and the
prefix is brought up to date, three ways side by side:

* ``path``: today's way, the document sorted by path and re-materialised: everything from
  the edited file on is computed again;
* ``append``: ``--order history``, ``tierkv materialize --refresh`` (the default mode): the
  changed file follows the unchanged document; compacts past ``--max-stale``;
* ``reorder``: ``--order history``, ``--refresh-mode reorder``: one copy per file, the changed
  file moved last.

Edits accumulate (trial 3 sees the edits of trials 1-2), as an agent's would. Reported per
way: recomputed tokens / tokens of the edited file, and refresh time / the full
materialisation's time, each trial and the median, and the totals over all trials (a
compaction is one large refresh that the median hides). With ``--check-logits`` (default on) the
last document of each way is also prefilled from the store and from nothing, and the last
logits compared (max abs diff).

    python scripts/bench_refresh.py --json
    python scripts/bench_refresh.py --tree ~/src/some-repo --trials 10 --json

The last line printed with ``--json`` is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import tierkv
from tierkv.document import DocumentOptions, build_document
from tierkv.hf import cached_prefill, load_model
from tierkv.materialize import load_prefix, materialize
from tierkv.quickstart import TinyModelSpec, build_tiny_model
from tierkv.refresh import refresh_prefix

WAYS = ("path", "append", "reorder")


def default_tree() -> Path:
    import click

    return Path(click.__file__).resolve().parent


def copy_tree(src: Path, dst: Path) -> Path:
    """``src`` as a git work tree at ``dst``: a clone when ``src`` is one (its history kept),
    else a copy committed once with a fixed date (the same order on every machine)."""
    if (src / ".git").exists():
        subprocess.run(["git", "clone", "-q", str(src), str(dst)], check=True)
        return dst
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
           "PATH": "/usr/bin:/bin"}
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
    subprocess.run(git + ["init", "-q"], cwd=dst, check=True, env=env)
    subprocess.run(git + ["add", "-A"], cwd=dst, check=True, env=env)
    subprocess.run(git + ["commit", "-q", "-m", "tree"], cwd=dst, check=True, env=env)
    return dst


def logits_diff(store, lm, tokens: list[int]) -> float:
    question = lm.encode_prompt("\nQuestion: where is the edited function?\nAnswer:")
    warm = cached_prefill(lm.model, tokens + question, store=store, scope=lm.scope("default"), store_new=False)
    cold = cached_prefill(lm.model, tokens + question)
    return float(torch.max(torch.abs(warm.logits - cold.logits)))


def run_way(way: str, source: Path, model_dir: Path, work: Path, trials: int, seed: int, max_stale: float,
            check: bool) -> dict:
    tree = copy_tree(source, work / f"tree-{way}")
    lm = load_model(model_dir)
    options = DocumentOptions(order="path" if way == "path" else "history")
    files = [f.path for f in build_document([tree], options).files]  # header paths: "<tree name>/..."
    rng = random.Random(seed)
    rows = []
    with tierkv.open(work / f"home-{way}", lm.layout) as store:
        t0 = time.perf_counter()
        full = materialize(store, lm, [tree], options, name="repo")
        full_s = time.perf_counter() - t0
        for trial in range(trials):
            rel = rng.choice(sorted(files))
            path = tree.parent / rel
            path.write_text(path.read_text(encoding="utf-8") + f"# edited in trial {trial}\n", encoding="utf-8")
            file_tokens = len(lm.encode_prompt(f"=== {rel} ===\n" + path.read_text(encoding="utf-8")))
            t0 = time.perf_counter()
            if way == "path":
                r, mode = materialize(store, lm, [tree], options, name="repo"), "rebuild"
            else:
                done = refresh_prefix(store, lm, "repo", mode=way, max_stale=max_stale)
                r, mode = done.result, done.mode
            seconds = time.perf_counter() - t0
            rows.append({"file": rel, "file_tokens": file_tokens, "recomputed": r.computed_tokens,
                         "tokens": r.tokens, "mode": mode, "refresh_s": round(seconds, 3),
                         "recomputed_per_file_token": round(r.computed_tokens / file_tokens, 3),
                         "time_vs_full": round(seconds / full_s, 4)})
            print(f"{way:8s} trial {trial}: {rel} ({file_tokens} tokens): {r.computed_tokens} recomputed "
                  f"of {r.tokens}, {seconds:.2f} s ({mode})", file=sys.stderr)
        diff = logits_diff(store, lm, load_prefix(store, lm, "repo").tokens) if check else None
    return {"full_tokens": full.tokens, "full_s": round(full_s, 3), "trials": rows,
            "median_recomputed_per_file_token": statistics.median(r["recomputed_per_file_token"] for r in rows),
            "median_time_vs_full": statistics.median(r["time_vs_full"] for r in rows),
            # The median hides a compaction's one large refresh: the totals show what it costs
            # over the whole run.
            "total_recomputed": sum(r["recomputed"] for r in rows),
            "total_file_tokens": sum(r["file_tokens"] for r in rows),
            "total_refresh_s": round(sum(r["refresh_s"] for r in rows), 2),
            "logits_max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=None, help="Tree to materialise [default: the installed click]")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-stale", type=float, default=0.25)
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--layers", type=int, default=2, help="Layers of the random-init model")
    ap.add_argument("--no-check-logits", dest="check", action="store_false")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    source = (args.tree or default_tree()).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-refresh-") as tmp:
        work = Path(tmp)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(source.rglob("*.py"))]
        spec = TinyModelSpec(num_layers=args.layers, hidden_size=64, num_heads=2, num_kv_heads=1,
                             intermediate_size=128, vocab_size=4096, context=1 << 18)
        model_dir = build_tiny_model(work / "model", texts, spec)
        out = {"tree": str(source), "trials": args.trials, "seed": args.seed, "max_stale": args.max_stale,
               "machine": f"{platform.machine()} {platform.processor() or ''} Python {platform.python_version()}, "
                          f"torch {torch.__version__}, {torch.get_num_threads()} threads".strip(),
               "ways": {}}
        for way in args.ways.split(","):
            out["ways"][way] = run_way(way, source, model_dir, work, args.trials, args.seed, args.max_stale,
                                       args.check)
    if args.json:
        print(json.dumps(out))
    else:
        for way, r in out["ways"].items():
            print(f"{way:8s} median recomputed/file tokens {r['median_recomputed_per_file_token']:8.2f}  "
                  f"median time/full {r['median_time_vs_full']:.3f}  total recomputed {r['total_recomputed']:,} "
                  f"for {r['total_file_tokens']:,} edited tokens  logits diff {r['logits_max_abs_diff']}")


if __name__ == "__main__":
    main()
