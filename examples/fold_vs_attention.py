"""FOLD on a drafter-sized cache, against the plain attention read the original drafter pays.

Shapes of the Llama-3.1-8B DFlash drafter (block of 10 rows, 32 query heads over 8 KV heads,
head_dim 128, W = 2048, alpha = 2). For each context length it times, side by side in one run
(alternated, medians and their spread over the repeats):

- ``packed``: the fair plain read. One ``scaled_dot_product_attention`` of the whole cache at true
  RoPE positions with the GQA group packed into the query axis, so each KV head is read once, as a
  DFlash engine reads it and as fold's own path does;
- ``fold``: ``fold.attention`` on the chosen key layout;
- ``gqa``: SDPA with ``enable_gqa=True``, which reads each KV head once per query head (a second
  column, to compare with what a naive baseline pays).

It also shows how far FOLD's output moves from the plain read.

    python -m examples.fold_vs_attention                       # 4K, 32K, 128K on this machine
    python -m examples.fold_vs_attention --keys-rotated        # the layout engines store
    python -m examples.fold_vs_attention --lengths 2048 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

import fold
from benchmarks.workloads import DRAFTERS, fold_call, make_inputs, sdpa_full_call, sdpa_packed_call, timed_rows
from fold.argtypes import at_least
from fold.fold_attention import MAX_ALPHA


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=at_least(1), nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--drafter", choices=sorted(DRAFTERS), default="llama3.1-8b")
    parser.add_argument("--alpha", type=float, default=2.0, help=f"in [1, {MAX_ALPHA:g}]")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--keys-rotated", action="store_true", help="the cache holds rotated keys")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--repeats", type=at_least(1), default=7)
    args = parser.parse_args(argv)
    if not 1.0 <= args.alpha <= MAX_ALPHA:
        parser.error(f"--alpha must lie in [1, {MAX_ALPHA:g}], got {args.alpha}")
    n_q = DRAFTERS[args.drafter].n_q
    if min(args.lengths) < n_q:
        parser.error(f"--lengths must be >= the block's n_q={n_q}, got {min(args.lengths)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    shape = DRAFTERS[args.drafter]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"fold {fold.__version__}, torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, "
          f"{args.dtype}, alpha={args.alpha}, keys_rotated={args.keys_rotated}, backend={args.backend}")
    print(f"{shape.name} drafter: n_q={shape.n_q}, heads {shape.heads_q}/{shape.heads_kv}, "
          f"head_dim {shape.head_dim}, W={shape.window}; medians of {args.repeats} alternated runs [min, max]\n")
    print(f"{'context':>8} {'packed ms':>20} {'FOLD ms':>20} {'gqa ms':>20} {'FOLD/packed':>12} {'FOLD/gqa':>9} "
          f"{'max|FOLD-plain|':>16}")
    for length in args.lengths:
        inputs = make_inputs(shape, length, dtype=getattr(torch, args.dtype), device=device,
                             keys_rotated=args.keys_rotated, alpha=args.alpha)
        fns = dict(packed=sdpa_packed_call(inputs), fold=fold_call(inputs, args.backend), gqa=sdpa_full_call(inputs))
        t = timed_rows(fns, args.repeats, sync)
        diff = (fns["fold"]().float() - fns["gqa"]().transpose(1, 2).float()).abs().max().item()
        cells = [f"{t[n][0] * 1e3:8.1f} [{t[n][1] * 1e3:.1f}, {t[n][2] * 1e3:.1f}]" for n in ("packed", "fold", "gqa")]
        print(f"{length:>8} " + " ".join(f"{c:>20}" for c in cells)
              + f" {t['fold'][0] / t['packed'][0]:>11.2f}x {t['fold'][0] / t['gqa'][0]:>8.2f}x {diff:>16.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
