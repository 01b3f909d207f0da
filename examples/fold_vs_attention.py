"""FOLD on a drafter-sized cache, against the plain attention read the original drafter pays.

Shapes of the Llama-3.1-8B DFlash drafter (block of 10 rows, 32 query heads over 8 KV heads,
head_dim 128, W = 2048, alpha = 2). For each context length it times, side by side in one run,
``fold.attention`` and one ``scaled_dot_product_attention`` read of the whole cache at true RoPE
positions, and shows how far FOLD's output moves from that plain read.

    python examples/fold_vs_attention.py                       # 4K, 32K, 128K on this machine
    python examples/fold_vs_attention.py --lengths 2048 8192 --dtype bfloat16 --keys-rotated
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tuning/ package

import fold  # noqa: E402
from tuning.workloads import DRAFTERS, fold_call, make_inputs, sdpa_full_call  # noqa: E402


def timed_pair(fn_a, fn_b, repeats):
    """Median seconds of a and b, alternated so both see the same machine state."""
    fn_a(), fn_b()
    times_a, times_b = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        t2 = time.perf_counter()
        times_a.append(t1 - t0)
        times_b.append(t2 - t1)
    return statistics.median(times_a), statistics.median(times_b)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--drafter", choices=sorted(DRAFTERS), default="llama3.1-8b")
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--keys-rotated", action="store_true", help="the cache holds rotated keys")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    shape = DRAFTERS[args.drafter]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"fold {fold.__version__}, torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, "
          f"{args.dtype}, alpha={args.alpha}, keys_rotated={args.keys_rotated}, backend={args.backend}")
    print(f"{shape.name} drafter: n_q={shape.n_q}, heads {shape.heads_q}/{shape.heads_kv}, "
          f"head_dim {shape.head_dim}, W={shape.window}\n")
    print(f"{'context':>8} {'plain SDPA ms':>14} {'FOLD ms':>9} {'FOLD/plain':>11} {'max|FOLD-plain|':>16}")
    for length in args.lengths:
        inputs = make_inputs(shape, length, dtype=getattr(torch, args.dtype), device=device,
                             keys_rotated=args.keys_rotated, alpha=args.alpha)
        run_fold, run_plain = fold_call(inputs, args.backend), sdpa_full_call(inputs)
        t_fold, t_plain = timed_pair(run_fold, run_plain, args.repeats)
        diff = (run_fold().float() - run_plain().transpose(1, 2).float()).abs().max().item()
        print(f"{length:>8} {t_plain * 1e3:>14.1f} {t_fold * 1e3:>9.1f} {t_fold / t_plain:>10.2f}x {diff:>16.4f}")


if __name__ == "__main__":
    main()
