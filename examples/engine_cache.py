"""Calling fold from an engine: a vLLM-style paged drafter cache read with one ``fold.attention`` call.

An engine keeps the drafter's KV cache as pages in one pool shared by every request, with keys
already rotated at their positions, and writes each new token's key/value to the slot a slot
mapping gives it (``slot = block * page_size + offset``). This script builds exactly that for a
batch of requests of different lengths (pages handed out of a shuffled free list, so a request's
pages are scattered across the pool), appends a draft block per request, and reads it with

    fold.attention(q, k_pool, v_pool, window=W, rope=rope, alpha=alpha, keys_rotated=True,
                   cache_seqlens=seqlens, block_table=block_table)

then checks the result against the dense float64 reference on each request's own contiguous cache.
Nothing beyond the cache is stored: no unrotated side cache, no copy of the pages.

    python -m examples.engine_cache
    python -m examples.engine_cache --page-size 16 --lengths 3000 700 5000 --window 512
"""

from __future__ import annotations

import argparse

import torch


from fold.argtypes import at_least
import fold
from reference import fold_attention_ref
from reference.tolerance import check_close


class PagedKVCache:
    """One layer's drafter cache as an engine keeps it: pages ``[num_blocks, page_size, heads_kv, head_dim]``
    for keys (rotated) and values, a free list, and per request a block table and a length."""

    def __init__(self, num_blocks, page_size, heads_kv, head_dim, rope, dtype=torch.float32, device="cpu", seed=0):
        self.k = torch.zeros(num_blocks, page_size, heads_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.page_size, self.rope = page_size, rope
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []

    def add_request(self) -> int:
        self.tables.append([])
        self.lengths.append(0)
        return len(self.tables) - 1

    def slot_mapping(self, request: int, count: int) -> torch.Tensor:
        """Slots of the request's next ``count`` entries, taking pages from the free list as needed."""
        start = self.lengths[request]
        table = self.tables[request]
        while len(table) * self.page_size < start + count:
            table.append(self.free.pop())
        positions = torch.arange(start, start + count)
        blocks = torch.tensor(table)[positions // self.page_size]
        return blocks * self.page_size + positions % self.page_size

    def append(self, request: int, k, v) -> None:
        """Write ``k, v [count, heads_kv, head_dim]`` (keys before RoPE) at the request's next positions:
        keys are rotated once, on write, as engines store them."""
        count = k.shape[0]
        slots = self.slot_mapping(request, count)
        positions = torch.arange(self.lengths[request], self.lengths[request] + count)
        k_rot = fold.rope.rotate(k.transpose(0, 1), positions, self.rope).transpose(0, 1)   # R_j k_j
        self.k.view(-1, *self.k.shape[2:])[slots] = k_rot.to(self.k.dtype)
        self.v.view(-1, *self.v.shape[2:])[slots] = v.to(self.v.dtype)
        self.lengths[request] += count

    def block_table(self) -> torch.Tensor:
        """[batch, max_blocks] int32; rows shorter than the longest are padded with -1 (never read)."""
        width = max(map(len, self.tables))
        table = torch.full((len(self.tables), width), -1, dtype=torch.int32)
        for b, row in enumerate(self.tables):
            table[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
        return table.to(self.k.device)

    def seqlens(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.int32, device=self.k.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=at_least(1), nargs="+", default=[1500, 400, 2600],
                    help="committed context entries per request")
    ap.add_argument("--page-size", type=at_least(1), default=16)
    ap.add_argument("--n-q", type=at_least(1), default=10, help="draft block rows")
    ap.add_argument("--heads", type=at_least(1), nargs=2, default=[8, 2], metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=at_least(1), default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    args = ap.parse_args(argv)
    if args.heads[0] % args.heads[1]:
        ap.error(f"--heads: HQ={args.heads[0]} must be a multiple of HKV={args.heads[1]}")
    if args.window < 0:
        ap.error(f"--window must be >= 0, got {args.window}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    heads_q, heads_kv = args.heads
    rope = fold.Rope.from_theta(500000.0, args.head_dim)
    total = sum(-(-(n + args.n_q) // args.page_size) for n in args.lengths)
    cache = PagedKVCache(total + 8, args.page_size, heads_kv, args.head_dim, rope, device=device)

    # prefill each request's context, then write its draft block (the block's own entries come last)
    raw = []
    for n in args.lengths:
        request = cache.add_request()
        k = torch.randn(n + args.n_q, heads_kv, args.head_dim, device=device)
        v = torch.randn(n + args.n_q, heads_kv, args.head_dim, device=device)
        cache.append(request, k[:n], v[:n])                       # prefill
        cache.append(request, k[n:], v[n:])                       # this round's block
        raw.append((k, v))
    q = torch.randn(len(args.lengths), args.n_q, heads_q, args.head_dim, device=device)

    out = fold.attention(q, cache.k, cache.v, window=args.window, rope=rope, alpha=args.alpha, keys_rotated=True,
                         cache_seqlens=cache.seqlens(), block_table=cache.block_table(), backend=args.backend)

    print(f"{len(args.lengths)} requests, {cache.k.shape[0]} pages of {args.page_size} entries in one pool, "
          f"keys rotated on write; block of {args.n_q} rows, {heads_q}/{heads_kv} heads, head_dim {args.head_dim}, "
          f"W={args.window}, alpha={args.alpha}")
    for b, (k, v) in enumerate(raw):
        kw = dict(window=args.window, rope=rope, alpha=args.alpha)
        truth, _ = fold_attention_ref(q[b:b + 1].cpu(), k[None].cpu(), v[None].cpu(), **kw)
        same_dtype, _ = fold_attention_ref(q[b:b + 1].cpu(), k[None].cpu(), v[None].cpu(), **kw, upcast=False)
        check_close(f"request {b}", out[b:b + 1], truth, same_dtype, torch.float32)
        err = (out[b:b + 1].cpu().double() - truth).abs().max().item()
        print(f"request {b}: {k.shape[0]:>6} entries on pages {cache.tables[b][:4]}... "
              f"max |fold - reference| = {err:.2e}")
    print("every request matches the dense reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
