"""FOLD's far read with a far budget against the full far read, side by side, on this CPU:

    OMP_NUM_THREADS=1 python -m benchmarks.bench_far_budget --lengths 32768 131072 262144 1048576 --threads 1

For each drafter shape and cache length ``L`` one ``fold.attention`` call of a draft block over a
bf16 pre-RoPE cache ``[1, L, 8, 128]`` (the ``fold.spec_decode`` layout, torch path), three ways, on the same
inputs and in turn (window-only, full, budgeted, window-only, ...), ``--repeats`` times:

- ``window``: ``far_position="none"``, FOLD's window alone: what every variant reads besides the far part;
- ``fold``: ``far_budget=None``, every far entry;
- ``budget``: ``far_budget=--budget`` (pages of ``--far-page``), ``far_bounds`` the kept bounds
  (``fold.far_pages.page_bounds`` built once beforehand, as a cache keeps them; building them is timed
  apart: ``bounds_from_scratch_ms`` is what ``far_bounds=None`` would add to every call, and
  ``update_one_round_ms`` what keeping them costs per round: ``update_bounds`` over ``n_q`` new entries);
- ``keys``: the same budget with ``far_rank="keys"`` (the listed pages ranked by their keys' far logits).

The far part's time is a variant's median minus the window-only median. Its bytes are counted from the
shapes: K and V of the far entries read (``L - W - n_q`` for ``fold``; at most ``budget`` for
``budget``, the pages a block straddles included) plus, for ``budget``, the float32 bounds of every
page the selection scores (``ceil(L / P) x Hkv x 2 x d x 4``), and for ``keys`` also the keys of the
listed pages it ranks (``min(candidates, shortlist x 16)`` pages, K only). A benchmark, not a test: absolute
times mean something on this machine only.

Shapes: ``llama3.1-8b``: 32 query / 8 KV heads of 128, ``n_q = 16`` (a block of 16), W = 2048,
theta 5e5; ``qwen3.5-9b``: ``benchmarks.workloads.DRAFTERS["qwen3.5-9b"]`` (32 / 8 heads of 128,
``n_q = 16``, W = 4096, theta 1e7).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.workloads import DRAFTERS, DrafterShape
import fold
from fold import far_pages

SHAPES = {"llama3.1-8b": dataclasses.replace(DRAFTERS["llama3.1-8b"], n_q=16), "qwen3.5-9b": DRAFTERS["qwen3.5-9b"]}
RESULTS = Path(__file__).parent / "results"
ELEMENT = 2                                   # bf16 cache


def make_cache(shape: DrafterShape, length: int, seed: int = 0, chunk: int = 1 << 16):
    """``q [1, n_q, Hq, d]``, ``k, v [1, L, Hkv, d]`` bf16, drawn a chunk at a time (no float32 copy of
    the cache at any length)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, shape.n_q, shape.heads_q, shape.head_dim, generator=g).to(torch.bfloat16)
    k = torch.empty(1, length, shape.heads_kv, shape.head_dim, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    for c0 in range(0, length, chunk):
        c1 = min(c0 + chunk, length)
        k[0, c0:c1] = torch.randn(c1 - c0, shape.heads_kv, shape.head_dim, generator=g).to(torch.bfloat16)
        v[0, c0:c1] = torch.randn(c1 - c0, shape.heads_kv, shape.head_dim, generator=g).to(torch.bfloat16)
    return q, k, v


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def far_bytes(shape: DrafterShape, length: int, budget: int | None, far_page: int, rank: str = "bound") -> dict:
    """Bytes the far part reads per call (one sequence, one layer), counted from the shapes."""
    row = shape.heads_kv * shape.head_dim * 2 * ELEMENT                     # K and V of one entry
    far = max(0, length - shape.window - shape.n_q)
    if budget is None:
        return dict(far_entries=far, kv_bytes=far * row, bounds_bytes=0, total_bytes=far * row)
    read = min(far, (budget // far_page) * far_page)
    bounds = -(-length // far_page) * shape.heads_kv * 2 * shape.head_dim * 4
    ranked = 0
    if rank == "keys":
        listed = min(far // far_page, far_pages.shortlist_size(budget // far_page) * far_pages.GROUP_PAGES)
        ranked = listed * far_page * row // 2                                     # K only
    return dict(far_entries=read, kv_bytes=read * row, bounds_bytes=bounds, ranked_key_bytes=ranked,
                total_bytes=read * row + bounds + ranked)


def bench(shape: DrafterShape, length: int, budget: int, far_page: int, repeats: int) -> dict:
    q, k, v = make_cache(shape, length)
    rope = fold.Rope.from_theta(shape.rope_theta, shape.head_dim)
    common = dict(window=shape.window, rope=rope, alpha=2.0, backend="torch")
    t0 = time.perf_counter()
    bounds = far_pages.page_bounds(k, far_page)
    scratch = time.perf_counter() - t0
    new = k[0, -shape.n_q:]
    positions = torch.arange(length - shape.n_q, length)
    update = statistics.median(_timed(lambda: far_pages.update_bounds(
        bounds, new, far_page=far_page, positions=positions, batch_index=torch.zeros_like(positions)))
        for _ in range(5))
    calls = {"window": lambda: fold.attention(q, k, v, **common, far_position="none"),
             "fold": lambda: fold.attention(q, k, v, **common),
             "budget": lambda: fold.attention(q, k, v, **common, far_budget=budget, far_page=far_page,
                                              far_bounds=bounds),
             "keys": lambda: fold.attention(q, k, v, **common, far_budget=budget, far_page=far_page,
                                            far_bounds=bounds, far_rank="keys")}
    full, budgeted = calls["fold"](), calls["budget"]()                   # warm-up; the outputs compared below
    calls["keys"]()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_timed(fn))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    diff = (full.float() - budgeted.float()).abs().max().item()
    return dict(drafter=shape.name, length=length, n_q=shape.n_q, window=shape.window, heads_q=shape.heads_q,
                heads_kv=shape.heads_kv, head_dim=shape.head_dim, budget=budget, far_page=far_page, repeats=repeats,
                window_ms=med["window"], fold_ms=med["fold"], budget_ms=med["budget"], keys_ms=med["keys"],
                fold_far_ms=med["fold"] - med["window"], budget_far_ms=med["budget"] - med["window"],
                keys_far_ms=med["keys"] - med["window"],
                times_ms={name: [round(x * 1e3, 2) for x in t] for name, t in times.items()},
                bounds_from_scratch_ms=scratch * 1e3, update_one_round_ms=update * 1e3,
                fold_far_bytes=far_bytes(shape, length, None, far_page),
                budget_far_bytes=far_bytes(shape, length, budget, far_page),
                keys_far_bytes=far_bytes(shape, length, budget, far_page, "keys"),
                max_abs_output_difference=diff)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Far budget vs full FOLD, CPU ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} thread(s); bf16 cache, torch path; "
             f"budget {rows[0]['budget']} entries in pages of {rows[0]['far_page']}; medians of each row's repeats.",
             "", "| drafter | L | window-only ms | fold ms (far part) | budget ms (far part) | keys ms (far part) | "
             "far bytes fold | far bytes budget (of which bounds) | far bytes keys (of which ranked keys) | "
             "bounds from scratch ms | update per round ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    mib = lambda b: f"{b / 2 ** 20:,.1f} MiB"  # noqa: E731
    for r in rows:
        fb, bb, kb = r["fold_far_bytes"], r["budget_far_bytes"], r["keys_far_bytes"]
        lines.append(f"| {r['drafter']} | {r['length']:,} | {r['window_ms']:.1f} | {r['fold_ms']:.1f} "
                     f"({r['fold_far_ms']:.1f}) | {r['budget_ms']:.1f} ({r['budget_far_ms']:.1f}) | "
                     f"{r['keys_ms']:.1f} ({r['keys_far_ms']:.1f}) | "
                     f"{mib(fb['total_bytes'])} | {mib(bb['total_bytes'])} ({mib(bb['bounds_bytes'])}) | "
                     f"{mib(kb['total_bytes'])} ({mib(kb['ranked_key_bytes'])}) | "
                     f"{r['bounds_from_scratch_ms']:.1f} | {r['update_one_round_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 262144, 1048576])
    ap.add_argument("--drafters", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--far-page", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-repeats", type=int, default=1, help="repeats at lengths above 262,144")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="results stem (default results/bench/far-budget-cpu-DATE)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    date = datetime.date.today().isoformat()
    meta = dict(date=date, command="OMP_NUM_THREADS=1 python -m benchmarks.bench_far_budget " + " ".join(
                    sys.argv[1:] if argv is None else argv),
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                torch=torch.__version__, threads=args.threads)
    rows = []
    with torch.inference_mode():
        for name in args.drafters:
            for length in args.lengths:
                repeats = args.repeats if length <= 262144 else args.long_repeats
                row = bench(SHAPES[name], length, args.budget, args.far_page, repeats)
                rows.append(row)
                print(f"{name} L={length}: window {row['window_ms']:.1f} ms, fold {row['fold_ms']:.1f} ms, "
                      f"budget {row['budget_ms']:.1f} ms, keys {row['keys_ms']:.1f} ms", flush=True)
    stem = Path(args.out) if args.out else RESULTS / f"far-budget-cpu-{date}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    text = markdown(rows, meta)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
