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
import time

import torch
import torch.nn.functional as F

import fold


def rotate(x, positions, rope):
    """R_pos x for x [..., L, H, d] (NeoX layout, full rotary), computed in float32."""
    angle = positions.float()[:, None] * rope.inv_freq                        # [L, d/2]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


def setup(length, *, batch=1, n_q=10, heads_q=32, heads_kv=8, head_dim=128, dtype=torch.float32, keys_rotated=False,
          seed=0):
    """Inputs shared by every provider: pre-RoPE q, the cache (unrotated or rotated), and the
    rotated copies a plain attention read needs."""
    g = torch.Generator().manual_seed(seed)
    rope = fold.Rope.from_theta(500000.0, head_dim)
    q = torch.randn(batch, n_q, heads_q, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, length, heads_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, length, heads_kv, head_dim, generator=g).to(dtype)
    k_rot = rotate(k[0], torch.arange(length), rope)[None]
    q_rot = rotate(q[0], torch.arange(length - n_q, length), rope)[None]
    return dict(q=q, k=k_rot if keys_rotated else k, v=v, q_rot=q_rot, k_rot=k_rot, rope=rope)


def plain_read(inputs):
    """The original drafter: one SDPA read of the full cache, rotated q and k, GQA."""
    return F.scaled_dot_product_attention(inputs["q_rot"].transpose(1, 2), inputs["k_rot"].transpose(1, 2),
                                          inputs["v"].transpose(1, 2), enable_gqa=True).transpose(1, 2)


def fold_read(inputs, *, window, alpha, keys_rotated, backend="auto"):
    return fold.attention(inputs["q"], inputs["k"], inputs["v"], window=window, rope=inputs["rope"], alpha=alpha,
                          keys_rotated=keys_rotated, backend=backend)


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
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--keys-rotated", action="store_true", help="the cache holds rotated keys")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"fold {fold.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"W={args.window}, alpha={args.alpha}, keys_rotated={args.keys_rotated}, backend={args.backend}")
    print("drafter shapes: n_q=10, heads 32/8, head_dim 128\n")
    print(f"{'context':>8} {'plain SDPA ms':>14} {'FOLD ms':>9} {'FOLD/plain':>11} {'max|FOLD-plain|':>16}")
    for length in args.lengths:
        inputs = setup(length, dtype=dtype, keys_rotated=args.keys_rotated)
        run_fold = lambda: fold_read(inputs, window=args.window, alpha=args.alpha,  # noqa: E731
                                     keys_rotated=args.keys_rotated, backend=args.backend)
        t_fold, t_plain = timed_pair(run_fold, lambda: plain_read(inputs), args.repeats)
        diff = (run_fold().float() - plain_read(inputs).float()).abs().max().item()
        print(f"{length:>8} {t_plain * 1e3:>14.1f} {t_fold * 1e3:>9.1f} {t_fold / t_plain:>10.2f}x {diff:>16.4f}")


if __name__ == "__main__":
    main()
