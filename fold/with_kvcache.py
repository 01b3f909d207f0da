"""``fold.attention_with_kvcache``: append a block's keys and values to the cache, then read it by FOLD.

The append form of :func:`fold.attention`, in flash-attention's ``flash_attn_with_kvcache`` convention:
``k``/``v`` are written into the cache in place at ``cache_seqlens`` (rotated there when asked),
``cache_batch_idx`` picks each sequence's cache row, ``cache_leftpad`` where its entries start. It is a
function of its own so that ``fold.attention`` stays a pure read.
"""

from __future__ import annotations

import math

import torch

from fold.checks import check_bool
from fold.fold_attention import attention, check_tensor
from fold.rope import Rope, rotate


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, window, rope, rotate_new_keys=False,
                           cache_batch_idx=None, cache_leftpad=None, block_table=None, **read):
    r"""Write the block's new keys and values into the cache, then :func:`fold.attention` over it.

    Sequence ``b`` lives in cache row ``cache_batch_idx[b]`` (default ``b``) of ``k_cache``/``v_cache``, its
    entries at indices ``[cache_leftpad[b], cache_seqlens[b] + n_new)`` of that row (a paged cache: through
    ``block_table[b]``, as in :func:`fold.attention`). Entry ``j`` of the sequence is at index
    ``cache_leftpad[b] + j`` and sits at position ``j``; the last ``n_q`` entries after the write are the
    block's own (``n_new <= n_q`` new rows, the rest already in the cache), as :func:`fold.attention` reads.

    Args:
        q: [batch, n_q, heads_q, head_dim], as :func:`fold.attention` takes it.
        k_cache, v_cache: [batch_cache, max_len, heads_kv, head_dim], or pages
            ``[num_blocks, page_size, heads_kv, head_dim]`` with ``block_table``. Written in place.
        k, v: None (nothing written), or [batch, n_new, heads_kv, head_dim] in the cache's dtype: written at
            indices ``cache_seqlens[b] .. cache_seqlens[b] + n_new - 1``.
        cache_seqlens: [batch] int tensor, or an int for every sequence: the index each sequence's entries end
            at before the write (flash-attention's: counted from the row's start, its leftpad included).
        rotate_new_keys: rotate ``k`` by ``rope`` at its positions (``index - cache_leftpad``) before the write,
            for a cache that holds rotated keys (read it with ``keys_rotated=True``). Default: False.
        cache_batch_idx: [batch] int tensor: the cache row of each sequence (a contiguous cache only).
        cache_leftpad: [batch] int tensor: the index each sequence's entries start at (a contiguous cache
            only). Its values choose the read's page size, so on CUDA they are read on the host (one sync).
        block_table: a paged cache, as :func:`fold.attention` takes it.
        window, rope, read: :func:`fold.attention`'s arguments (``alpha``, ``keys_rotated``, ``softcap``, ...).

    Returns:
        what :func:`fold.attention` returns for the sequences after the write.

    Differences from ``flash_attn_with_kvcache`` (``docs/flash-attn-kvcache.md`` lists every argument):
    positions count from each sequence's start (its leftpad), where flash-attention's rotary tables are
    indexed by the cache index; RoPE is ``rope`` (no per-position tables); the block is bidirectional unless
    ``causal=True``; there is no ALiBi.
    """
    batch, n_q = q.shape[:2]
    paged = block_table is not None
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("cache_batch_idx and cache_leftpad take a contiguous cache; with block_table, point the "
                         "table's rows at the pages instead (as flash-attention does)")
    check_bool("rotate_new_keys", rotate_new_keys)
    if not isinstance(rope, Rope):
        raise TypeError(f"rope must be a fold.Rope, got {type(rope).__name__}")
    rows = k_cache.shape[0] if not paged else batch
    seqlens = _index_vector("cache_seqlens", cache_seqlens, batch, q.device)
    batch_idx = _index_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
    leftpad = _index_vector("cache_leftpad", cache_leftpad, batch, q.device)
    if not paged:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(name, x, "[batch_cache, max_len, heads_kv, head_dim]")
            if (batch_idx is not None or leftpad is not None) and not x.is_contiguous():
                raise ValueError(f"{name} must be contiguous with cache_batch_idx or cache_leftpad (its rows are "
                                 "read as pages of the same storage)")
        if batch_idx is None and rows != batch:
            raise ValueError(f"k_cache must have batch={batch} rows without cache_batch_idx, got {rows}")
    n_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v are given together (the new rows) or not at all")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            check_tensor(name, x, f"[batch={batch}, n_new, heads_kv, head_dim]")
        n_new = k.shape[1]
        want = (batch, n_new) + tuple(k_cache.shape[2:])
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k and v must have shape [batch, n_new, heads_kv, head_dim] = {list(want)}, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.device != k_cache.device:
            raise TypeError(f"k and v must have the cache's dtype {k_cache.dtype} and device, got {k.dtype} and "
                            f"{v.dtype} on {k.device}")
        if n_new > n_q:
            raise ValueError(f"k holds n_new={n_new} rows, more than the block's n_q={n_q}")
    start = leftpad if leftpad is not None else torch.zeros_like(seqlens)
    if k is not None:
        _write(k_cache, v_cache, k, v, seqlens, start, batch_idx, block_table, rope if rotate_new_keys else None)
    k_read, v_read, table = _sequences(k_cache, v_cache, batch_idx, leftpad, block_table, batch)
    return attention(q, k_read, v_read, window=window, rope=rope, cache_seqlens=seqlens + n_new - start,
                     block_table=table, **read)


def _index_vector(name, x, batch, device):
    """None, an int (``cache_seqlens`` only) or a [batch] integer tensor -> int64 tensor on ``device`` or None."""
    if x is None:
        if name == "cache_seqlens":
            raise ValueError("cache_seqlens is required (where each sequence's entries end)")
        return None
    if isinstance(x, int) and not isinstance(x, bool) and name == "cache_seqlens":
        return torch.full((batch,), x, dtype=torch.int64, device=device)
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or x.shape != (batch,):
        raise TypeError(f"{name} must be a [batch={batch}] int32/int64 tensor"
                        f"{' or an int' if name == 'cache_seqlens' else ''}, got "
                        f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")
    return x.long()


def _write(k_cache, v_cache, k, v, seqlens, start, batch_idx, block_table, rope):
    """``k, v [B, n_new, Hkv, d]`` into the cache at ``seqlens[b] + i`` (``rope``: rotated at ``seqlens[b] + i -
    start[b]`` first). One scatter each, no host read."""
    batch, n_new = k.shape[:2]
    index = seqlens[:, None] + torch.arange(n_new, device=k.device)                 # [B, n_new]
    if rope is not None:
        positions = (index - start[:, None]).flatten()
        k = rotate(k.flatten(0, 1).transpose(0, 1), positions, rope).transpose(0, 1).view_as(k).to(k_cache.dtype)
    if block_table is not None:
        page = k_cache.shape[1]
        rows, cols = block_table.gather(1, index // page).long(), index % page
    else:
        rows = (batch_idx if batch_idx is not None else torch.arange(batch, device=k.device))[:, None].expand_as(index)
        cols = index
    k_cache[rows, cols] = k
    v_cache[rows, cols] = v


def _sequences(k_cache, v_cache, batch_idx, leftpad, block_table, batch):
    """The cache as :func:`fold.attention` reads it, with no copy: ``(k, v, block_table)``. Rows picked by
    ``batch_idx`` or starting at ``leftpad`` become pages of a block table over the same storage: one page
    per row (``batch_idx`` alone), or pages of ``gcd(max_len, leftpads)`` entries."""
    if block_table is not None or (batch_idx is None and leftpad is None):
        return k_cache, v_cache, block_table
    rows, max_len = k_cache.shape[:2]
    row = batch_idx if batch_idx is not None else torch.arange(batch, device=k_cache.device)
    page = max_len if leftpad is None else math.gcd(max_len, *leftpad.tolist())
    pages_per_row = max_len // page
    first = row * pages_per_row + (0 if leftpad is None else leftpad // page)          # [B]
    count = pages_per_row
    table = (first[:, None] + torch.arange(count, device=k_cache.device)).clamp(max=rows * pages_per_row - 1)
    shape = (rows * pages_per_row, page) + tuple(k_cache.shape[2:])
    return k_cache.view(shape), v_cache.view(shape), table.to(torch.int32)
