"""The PyTorch path of ``fold.attention`` and ``fold.tree_attention``: any device, memory-bounded,
at the speed of a packed plain read on the CPU.

Per sequence the KV axis splits into three segments (``win_lo = n - D + 1``, ``far_hi = n - W``)::

    [0, win_lo)        far for every row     -> fused reads that return their LSE (alpha * scale)
    [win_lo, far_hi)   n_q - 1 mixed entries -> explicit logits, a per-row mask, both branches
    [far_hi, L)        window for every row  -> fused reads of the W + n_q keys at exact positions

GQA heads are packed into the query axis (``[heads_kv, n_q * group, d]``), so each KV head is read
once, as a plain read packs them. A segment whose keys are usable as stored (the far memory of an
unrotated cache, the window of a rotated one) is one fused read of a view of the cache: no copy.
Keys that need a rotation (the window of an unrotated cache, the far memory of a rotated one) or a
page gather (a paged cache) are prepared a cache-sized chunk at a time, read while still in cache,
and the chunk states merged online, so memory stays ``O(chunk)`` at any length and the extra work is
one pass over keys already in L2. Angles are formed in float64 (:func:`fold.rope.rotate`).
"""

from __future__ import annotations

import torch

from fold.masked import masked_attention
from fold.merge import merge_into, merge_pair
from fold.rope import rotate, rotate_with, work_dtype

CHUNK_BYTES = 4 << 20   # keys prepared per step (float32), read while still in L2/L3 (1,024 entries at 8 x 128)
MATH_CHUNK = 4096       # entries per step where no fused kernel returns the LSE (non-CPU devices)


class _Cache:
    """The keys and values of one sequence, contiguous ``[max_len, Hkv, d]`` or paged
    (``pages [num_blocks, page_size, Hkv, d]`` and that sequence's ``table [max_blocks]``)."""

    def __init__(self, k, v, b, block_table=None):
        self.paged = block_table is not None
        if self.paged:
            self.k, self.v, self.table, self.page = k, v, block_table[b].long(), k.shape[1]
        else:
            self.k, self.v = k[b], v[b]

    def rows(self, lo: int, hi: int):
        """Entries ``[lo, hi)`` as ``[N, Hkv, d]`` each: views of a contiguous cache, gathered pages otherwise."""
        if not self.paged:
            return self.k[lo:hi], self.v[lo:hi]
        p0, p1 = lo // self.page, (hi - 1) // self.page + 1
        pages = self.table[p0:p1]
        start = lo - p0 * self.page
        return (self.k[pages].flatten(0, 1)[start:start + hi - lo],
                self.v[pages].flatten(0, 1)[start:start + hi - lo])

    def as_stored(self) -> bool:
        """Whole segments can be read in place (contiguous, unit stride on the last dim)."""
        return not self.paged and self.k.stride(-1) == 1 and self.v.stride(-1) == 1


def _empty_state(q):
    return torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)


def _fused_read(q, k, v, scale, mask=None):
    """``q [H, M, d]``, ``k, v [H, N, d]`` (unit stride on the last dim), one dtype, ``mask`` None or
    additive ``[M, N]`` (0 or -inf; every row sees at least one entry) -> ``(o, lse)``."""
    if q.device.type == "cpu":
        # the CPU's fused flash kernel returns the LSE; it is wrong for a last dim with stride != 1
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], scale=scale, attn_mask=None if mask is None else mask.to(q.dtype)[None, None])
        return o[0], lse[0]
    work = work_dtype(q.dtype)
    state = _empty_state(q.to(work))
    for c0 in range(0, k.shape[1], MATH_CHUNK):
        kc, vc = k[:, c0:c0 + MATH_CHUNK].to(work), v[:, c0:c0 + MATH_CHUNK].to(work)
        s = torch.einsum("hmd,hnd->hmn", q.to(work), kc) * scale
        if mask is not None:
            s = s + mask[:, c0:c0 + MATH_CHUNK].to(work)
        state = merge_pair(*state, torch.softmax(s, dim=-1) @ vc, torch.logsumexp(s, dim=-1))
    return state


def _chunk_mask(head_mask, lo, c0, c1):
    """The additive mask of entries ``[c0, c1)`` given ``head_mask [M, K]`` for the segment's first K
    entries (``lo`` onwards; every later entry visible), or None where it is all zeros."""
    if head_mask is None or c0 - lo >= head_mask.shape[1]:
        return None
    mask = head_mask.new_zeros(head_mask.shape[0], c1 - c0)
    part = head_mask[:, c0 - lo:c1 - lo]
    mask[:, :part.shape[1]] = part
    return mask


def _read(q, cache: _Cache, lo: int, hi: int, scale: float, rope=None, inverse: bool = False, head_mask=None):
    """Attention of ``q [Hkv, M, d]`` (work dtype) over entries ``[lo, hi)``; with ``rope`` entry j's key
    is first rotated by ``j`` (by ``-j`` with ``inverse``), a pure rotation.
    ``head_mask [M, K]`` (additive) hides some of the first K entries from some rows. Returns ``(o, lse)``
    in q's dtype."""
    if hi <= lo:
        return _empty_state(q)
    kv_dtype = cache.k.dtype
    q_in = q.to(kv_dtype)
    if rope is None and cache.as_stored():
        k, v = cache.rows(lo, hi)
        o, lse = _fused_read(q_in, k.transpose(0, 1), v.transpose(0, 1), scale, _chunk_mask(head_mask, lo, lo, hi))
        return o.to(q.dtype), lse.to(q.dtype)
    heads_kv, head_dim = cache.k.shape[-2], cache.k.shape[-1]
    chunk = max(64, CHUNK_BYTES // (heads_kv * head_dim * 4))
    chunk = -(-(hi - lo) // -(-(hi - lo) // chunk))                           # balanced: no tiny last chunk
    if head_mask is not None:                       # the first chunk must hold an entry every row sees
        chunk = max(chunk, head_mask.shape[1] + 1)
    # rotated keys are written as the cache stores them, [C, Hkv, d]: the fastest layout to write
    buf = torch.empty(min(chunk, hi - lo), heads_kv, head_dim, dtype=q.dtype, device=q.device) if rope else None
    state = None
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        k, v = cache.rows(c0, c1)                                                 # [C, Hkv, d]
        if rope is not None:
            cos, sin = rope.cos_sin(c0, c1 - c0, dtype=q.dtype, device=q.device)        # the kept table of j
            k = rotate_with(k, cos[:, None], sin[:, None], rope, inverse=inverse,
                            out=buf[:c1 - c0] if k.dtype == q.dtype else None)
            k = k.to(kv_dtype)
        elif k.stride(-1) != 1:
            k = k.contiguous()
        k, v = k.transpose(0, 1), v.transpose(0, 1)                               # [Hkv, C, d]
        o, lse = _fused_read(q_in, k, v if v.stride(-1) == 1 else v.contiguous(), scale,
                             _chunk_mask(head_mask, lo, c0, c1))
        state = merge_into(state, o.to(q.dtype), lse.to(q.dtype))
    return state


def _rotate_rows(qm, start, rope, factor, per_row=True):
    """``qm [Hkv, n_q, group, d]`` (work dtype) rotated at ``start + r`` for row r (``start`` for every
    row without ``per_row``) with ``factor`` -> ``[Hkv, n_q * group, d]``; tables from :meth:`Rope.cos_sin`."""
    n_q = qm.shape[1]
    cos, sin = rope.cos_sin(start, n_q if per_row else 1, dtype=qm.dtype, device=qm.device)   # [n_q or 1, half]
    return rotate_with(qm, (cos * factor)[:, None], (sin * factor)[:, None], rope).flatten(1, 2)


def _pack(x, heads_kv):
    # [n, Hq, d] -> [Hkv, n * group, d]: row m = r * group + h
    n, heads_q, head_dim = x.shape
    return x.view(n, heads_kv, heads_q // heads_kv, head_dim).transpose(0, 1).reshape(heads_kv, -1, head_dim)


def _unpack(x, n):
    # [Hkv, n * group, ...] -> [n, Hq, ...]
    heads_kv, rows = x.shape[:2]
    return x.reshape(heads_kv, n, rows // n, *x.shape[2:]).transpose(0, 1).reshape(n, heads_kv * (rows // n),
                                                                                   *x.shape[2:])


def fold_attention_torch(q, k, v, rope, cache_seqlens, *, window, alpha, softmax_scale, keys_rotated, return_lse,
                         block_table=None, far_per_row=True, queries_rotated=False):
    """Same contract as the Triton launcher: validated inputs in, ``(out, lse or None)`` out.

    ``k, v`` are ``[batch, max_len, Hkv, d]``, or pages ``[num_blocks, page_size, Hkv, d]`` with
    ``block_table [batch, max_blocks]``. ``far_per_row=False`` reads every far entry at
    distance ``D`` from every row instead of ``D + r`` (ReRoPE's rule). ``queries_rotated``: ``q``
    holds ``R_{n+r} q``; the window reads it as it is and the far branch turns it on by the difference
    of the two positions.
    """
    batch, n_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    work = work_dtype(q.dtype)
    if cache_seqlens is None:
        seqlens = [k.shape[1]] * batch
    else:
        seqlens = cache_seqlens.tolist()
    f = rope.attention_factor
    # R_0 k = f k on the rotary dims, and the window's R_j k carries f too: q takes its own factor unless
    # it arrives rotated, and the key's unless the cache already holds it (un-rotating is pure)
    q_factor = (1.0 if queries_rotated else f) * (1.0 if keys_rotated else f)
    row_r = torch.arange(n_q, device=q.device).repeat_interleave(heads_q // heads_kv)   # [M] row m = r * group + h
    out = torch.empty_like(q)
    lse_out = torch.empty(batch, n_q, heads_q, device=q.device, dtype=work) if return_lse else None
    for b, length in enumerate(seqlens):
        cache = _Cache(k, v, b, block_table)
        n = length - n_q
        win_lo, far_hi = n - window - n_q + 1, n - window
        a, c = max(0, win_lo), max(0, far_hi)
        qm = _pack(q[b], heads_kv).to(work).view(heads_kv, n_q, -1, head_dim)        # [Hkv, n_q, group, d]
        far_start = window + n_q
        if queries_rotated:          # q at n + r: turn by D + r - (n + r) (shared) or D - (n + r) (fixed)
            if far_per_row:
                q_far = _rotate_rows(qm, far_start - n, rope, q_factor, per_row=False)
            else:
                turn = far_start - n - torch.arange(n_q, device=q.device)
                q_far = rotate(qm.transpose(1, 2), turn, rope, factor=q_factor).transpose(1, 2).flatten(1, 2)
            q_win = _rotate_rows(qm, 0, rope, q_factor, per_row=False)               # already at n + r
        else:
            q_far = _rotate_rows(qm, far_start, rope, q_factor, per_row=far_per_row)
            q_win = _rotate_rows(qm, n, rope, q_factor)                              # rows at n + r

        far = _read(q_far, cache, 0, a, alpha * softmax_scale, *((rope, True) if keys_rotated else ()))
        # the window read starts at the n_q - 1 mixed entries [a, c): row r sees entry j iff j >= win_lo + r
        jm = torch.arange(a, c, device=q.device)
        in_window = jm[None, :] >= (win_lo + row_r)[:, None]                            # [M, c - a]
        head_mask = torch.zeros(in_window.shape, dtype=work, device=q.device).masked_fill_(~in_window, float("-inf"))
        win = _read(q_win, cache, a, length, softmax_scale, *(() if keys_rotated else (rope, False)),
                    head_mask=head_mask if c > a else None)
        if c > a:                                                                       # their far part
            km, vm = cache.rows(a, c)
            km, vm = km.transpose(0, 1).to(work), vm.transpose(0, 1).to(work)            # [Hkv, c - a, d]
            k_far = rotate(km, -jm, rope, factor=1.0) if keys_rotated else km
            far = merge_pair(*far, *masked_attention(q_far, k_far, vm, ~in_window, alpha * softmax_scale))
        o, lse = merge_pair(*win, far[0], far[1] / alpha)                              # [Hkv, M, d], [Hkv, M]
        out[b] = _unpack(o, n_q)
        if return_lse:
            lse_out[b] = _unpack(lse, n_q)
    return out, lse_out


def tree_attention_torch(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens, *, softmax_scale,
                         return_lse, block_table=None):
    """Hybrid tree attention: the cache through fused reads with LSE, the tree explicitly, one merge."""
    batch, n_tree, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    work = work_dtype(q.dtype)
    seqlens = [k_cache.shape[1]] * batch if cache_seqlens is None else cache_seqlens.tolist()
    node = torch.arange(n_tree, device=q.device).repeat_interleave(heads_q // heads_kv)   # row m = i * group + h
    out = torch.empty_like(q)
    lse_out = torch.empty(batch, n_tree, heads_q, device=q.device, dtype=work) if return_lse else None
    for b, length in enumerate(seqlens):
        qm = _pack(q[b], heads_kv).to(work)
        cached = _read(qm, _Cache(k_cache, v_cache, b, block_table), 0, length, softmax_scale)
        tree = masked_attention(qm, k_tree[b].transpose(0, 1).to(work), v_tree[b].transpose(0, 1).to(work),
                                tree_mask[b][node], softmax_scale)
        o, lse = merge_pair(*cached, *tree)
        out[b] = _unpack(o, n_tree)
        if return_lse:
            lse_out[b] = _unpack(lse, n_tree)
    return out, lse_out
