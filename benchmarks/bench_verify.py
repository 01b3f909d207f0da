"""What a verification costs on the target side, per layer and per round, measured side by side:

    OMP_NUM_THREADS=1 python -m benchmarks.bench_verify --lengths 2048 8192 --threads 1

- attention of ``--rows`` query rows (the anchor and the drafts) over ``L`` cached keys of a
  grouped-query layer (default: SmolLM2-135M's 9 query / 3 K/V heads of 64) under the verification's
  mask: transformers' SDPA function (``repeat_kv`` copies K/V for several rows) against
  ``fold.spec_decode.swap.grouped_sdpa`` (the query heads of a K/V head stacked as rows), and one row
  (plain decoding) for scale;
- the LM head (default 49,152 x 576) on every row of a round against one row, what a round pays with
  ``fold.spec_decode.session.LogitRows`` per row acceptance reads.

A benchmark, not a test: medians of ``--repeats`` calls; an absolute time means something on this
machine only, the ratios printed beside them are the result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def attention_row(length: int, rows: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fold.spec_decode.swap import grouped_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, rows, head_dim, generator=g)
    k = torch.randn(1, kv_heads, length, head_dim, generator=g)
    v = torch.randn(1, kv_heads, length, head_dim, generator=g)
    mask = (torch.arange(length)[None] <= torch.arange(length - rows, length)[:, None])[None, None]

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = heads // kv_heads, True
    layer = Layer()
    stock = _median_ms(lambda: sdpa_attention_forward(layer, q, k, v, mask), repeats)
    grouped = _median_ms(lambda: grouped_sdpa(layer, q, k, v, mask), repeats)
    one = _median_ms(lambda: sdpa_attention_forward(layer, q[:, :, -1:], k, v, None), repeats)
    return dict(length=length, rows=rows, transformers_ms=stock, grouped_ms=grouped, one_row_ms=one)


def head_row(rows: int, vocab: int, hidden: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    x = torch.randn(1, rows, hidden, generator=g)
    with torch.no_grad():
        every = _median_ms(lambda: head(x), repeats)
        one = _median_ms(lambda: head(x[:, :1]), repeats)
    return dict(rows=rows, every_row_ms=every, one_row_ms=one)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rows", type=int, default=9, help="anchor + drafts verified per round")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of {args.repeats}")
    print(f"attention, {args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.rows} rows, per layer:")
    for length in args.lengths:
        r = attention_row(length, args.rows, args.heads, args.kv_heads, args.head_dim, args.repeats)
        print(f"  {length:6d} keys: transformers {r['transformers_ms']:.2f} ms, grouped {r['grouped_ms']:.2f} ms "
              f"({r['transformers_ms'] / r['grouped_ms']:.1f}x less), one row {r['one_row_ms']:.2f} ms")
    h = head_row(args.rows, args.vocab, args.hidden, args.repeats)
    print(f"LM head {args.vocab} x {args.hidden}: {args.rows} rows {h['every_row_ms']:.1f} ms, one row "
          f"{h['one_row_ms']:.1f} ms ({h['every_row_ms'] / h['one_row_ms']:.1f}x)")


if __name__ == "__main__":
    main()
