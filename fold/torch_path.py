"""The PyTorch path of ``fold.attention`` and ``fold.tree_attention``: any device, memory-bounded,
at the speed of a packed plain read on the CPU.

Per sequence the KV axis splits into segments (:func:`fold_attention_torch`): the entries far for
every row and those local for every row are fused reads that return their LSE; the ``n_q - 1``
entries that turn far row by row and the block's own ``n_q`` entries (causal or not) are explicit
logits under a per-row mask.

GQA heads are packed into the query axis (``[heads_kv, n_q * group, d]``), so each KV head is read
once, as a plain read packs them. A segment whose keys are usable as stored (the far memory of an
unrotated cache, the window of a rotated one) is one fused read of a view of the cache: no copy.
Keys that need a rotation (the window of an unrotated cache, the far memory of a rotated one) or a
page gather (a paged cache) are prepared a chunk at a time (:data:`CHUNK_BYTES`), read while still in
cache, and the chunk states merged once at the end, so memory stays ``O(chunk)`` at any length and the
extra work is one pass over keys still in cache. Each parallel torch op is a region that waits for its
slowest thread, and under CPU load (another process on one core) that thread is often descheduled, so
the small ops run on one thread and only the fused reads are parallel (:func:`_serial_on_cpu`): a few
regions a read, as the plain read (``results/bench/cpu-load.md``). Angles are formed in float64
(:func:`fold.rope.rotate`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import torch

from fold.masked import masked_attention, soft_cap
from fold.merge import merge_pair
from fold.rope import rotate, rotate_with, work_dtype

CHUNK_BYTES = 4 << 20   # keys prepared per step (float32), read back while still in cache (1,024 entries at 8 x 128)
MERGE_STATES = 64       # chunk states kept before they are merged (each [Hkv, M, d])
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

    def take(self, j: torch.Tensor):
        """Entries at the positions ``j [N]`` (any order) as ``[N, Hkv, d]`` each."""
        if not self.paged:
            return self.k[j], self.v[j]
        pages, slots = self.table[j // self.page], j % self.page
        return self.k[pages, slots], self.v[pages, slots]

    def take_heads(self, j: torch.Tensor):
        """Entries at the positions ``j [Hkv, N]``, each KV head its own, as ``[Hkv, N, d]`` each."""
        head = torch.arange(j.shape[0], device=j.device)[:, None]
        if not self.paged:
            return self.k[j, head], self.v[j, head]
        pages, slots = self.table[j // self.page], j % self.page
        return self.k[pages, slots, head], self.v[pages, slots, head]

    def as_stored(self, dtype) -> bool:
        """Whole segments can be read in place: contiguous, in ``dtype``, unit stride on the last dim."""
        return (not self.paged and self.k.dtype == dtype and self.k.stride(-1) == 1 and self.v.stride(-1) == 1)


def _empty_state(q):
    return torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)


_THREADS = threading.local()      # .full: the caller's intra-op threads while a read runs serially


def _serial_on_cpu(fn):
    """Run ``fn``'s torch ops on one intra-op thread when its ``q`` is on the CPU, but for the fused
    reads (:func:`_fused_read`), which take the caller's threads back.

    Every parallel op is an OpenMP region that waits for all of its threads, and with another process
    busy on a core the second thread is often descheduled: measured here, any op of more than a few
    thousand elements then costs ~8 ms, whatever its size. A read is ~40 such small ops (query
    rotations, the explicit entries, merges) plus a few per chunk; run serially they cost microseconds,
    and the fused reads, the bulk of the work, stay parallel: a few regions a read, as the plain read.
    OpenMP's thread count is per calling thread, so other threads of the process are not affected
    (MKL's count is global, and is 1 while a read runs)."""
    @functools.wraps(fn)
    def serial(q, *args, **kwargs):
        with serial_on_cpu(q.device):
            return fn(q, *args, **kwargs)
    return serial


@contextlib.contextmanager
def serial_on_cpu(device: torch.device):
    """The block's torch ops on one intra-op thread when ``device`` is the CPU (the caller's count kept
    for the fused reads and restored after; see :func:`_serial_on_cpu`). A no-op on other devices, at
    one thread, inside an outer serial block, and while ``torch.compile`` traces."""
    full = torch.get_num_threads()
    if (device.type != "cpu" or full == 1 or getattr(_THREADS, "full", None)
            or torch.compiler.is_compiling()):
        yield
        return
    _THREADS.full = full
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(full)
        _THREADS.full = None


@contextlib.contextmanager
def parallel_in_serial():
    """Inside :func:`serial_on_cpu`, the caller's intra-op threads back for one large op (a fused read, a
    big product), then one thread again; a no-op outside."""
    full = getattr(_THREADS, "full", None)
    if not full:
        yield
        return
    torch.set_num_threads(full)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def _fused_read(q, k, v, scale, softcap=0.0, alpha=1.0):
    """``q [H, M, d]``, ``k, v [H, N, d]`` (unit stride on the last dim, ``N >= 1``), one dtype -> ``(o, lse)``
    of the logits ``alpha * cap(q.k * scale)`` (``softcap``: :func:`fold.masked.soft_cap`)."""
    if q.device.type == "cpu" and not softcap:
        # the CPU's fused flash kernel returns the LSE; it is wrong for a last dim with stride != 1
        with parallel_in_serial():      # the bulk of a serial read's work: on the caller's threads
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None],
                                                                                scale=scale * alpha)
        return o[0], lse[0]
    work = work_dtype(q.dtype)
    state = _empty_state(q.to(work))
    for c0 in range(0, k.shape[1], MATH_CHUNK):
        kc, vc = k[:, c0:c0 + MATH_CHUNK].to(work), v[:, c0:c0 + MATH_CHUNK].to(work)
        s = torch.einsum("hmd,hnd->hmn", q.to(work), kc)
        s = soft_cap(s * scale, softcap) * alpha if softcap else s * (scale * alpha)
        state = merge_pair(*state, torch.softmax(s, dim=-1) @ vc, torch.logsumexp(s, dim=-1))
    return state


def _merge_all(states):
    """One merge of non-empty states ``[(o [..., d], lse [...])]`` (a few ops, whatever their number)."""
    if len(states) == 1:
        return states[0]
    lse = torch.stack([x[1] for x in states])                                # [S, ...]
    m = lse.amax(0)
    w = torch.exp(lse - m)
    total = w.sum(0)
    o = torch.einsum("s...,s...d->...d", w / total, torch.stack([x[0] for x in states]))
    return o, m + torch.log(total)


_SCRATCH = threading.local()


def _scratch(shape, dtype, device):
    """A buffer of ``shape`` for a chunk's rotated keys, every element written before it is read. On a CPU one
    buffer per thread is kept and grown (up to :data:`CHUNK_BYTES` of float32): a fresh allocation of MBs
    page-faults on its first write at every call (the window's 8 MiB: 1 ms of a 32K read's 9, measured)."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    size = math.prod(shape)
    held = getattr(_SCRATCH, "buffer", None)
    if held is None or held.dtype != dtype or held.numel() < size:
        with torch.inference_mode(False):           # a normal tensor: writable in and out of inference mode
            held = _SCRATCH.buffer = torch.empty(size, dtype=dtype)
    return held[:size].view(shape)


def _read(q, cache: _Cache, lo: int, hi: int, scale: float, read_dtype, rope=None, inverse: bool = False,
          softcap: float = 0.0, alpha: float = 1.0):
    """Attention of ``q [Hkv, M, d]`` (work dtype) over entries ``[lo, hi)``, every row seeing every
    entry, logits ``alpha * cap(q.k * scale)``; with ``rope`` entry j's key is first rotated by ``j`` (by
    ``-j`` with ``inverse``), a pure rotation. Keys and values are read in ``read_dtype`` (a cache in
    another dtype, FP8 or half, is converted a chunk at a time). Returns ``(o, lse)`` in q's dtype."""
    if hi <= lo:
        return _empty_state(q)
    q_in = q.to(read_dtype)
    if rope is None and cache.as_stored(read_dtype):
        k, v = cache.rows(lo, hi)
        o, lse = _fused_read(q_in, k.transpose(0, 1), v.transpose(0, 1), scale, softcap, alpha)
        return o.to(q.dtype), lse.to(q.dtype)
    heads_kv, head_dim = cache.k.shape[-2], cache.k.shape[-1]
    chunk = max(64, CHUNK_BYTES // (heads_kv * head_dim * 4))
    chunk = -(-(hi - lo) // -(-(hi - lo) // chunk))                           # balanced: no tiny last chunk
    # rotated keys are written as the cache stores them, [C, Hkv, d]: the fastest layout to write
    buf = _scratch((min(chunk, hi - lo), heads_kv, head_dim), q.dtype, q.device) if rope else None
    states = []
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        k, v = cache.rows(c0, c1)                                                 # [C, Hkv, d]
        # a chunk's conversion and rotation are large ops (CHUNK_BYTES of keys): the caller's threads, as the read
        with parallel_in_serial():
            k, v = k.to(read_dtype), v.to(read_dtype)                             # an FP8 or half cache: converted
            if rope is not None:
                cos, sin = rope.cos_sin(c0, c1 - c0, dtype=q.dtype, device=q.device)    # the kept table of j
                k = rotate_with(k, cos[:, None], sin[:, None], rope, inverse=inverse,
                                out=buf[:c1 - c0] if k.dtype == q.dtype else None)
        k, v = k.to(read_dtype).transpose(0, 1), v.transpose(0, 1)                # [Hkv, C, d]
        o, lse = _fused_read(q_in, k if k.stride(-1) == 1 else k.contiguous(),
                             v if v.stride(-1) == 1 else v.contiguous(), scale, softcap, alpha)
        states.append((o.to(q.dtype), lse.to(q.dtype)))
        if len(states) == MERGE_STATES:
            states = [_merge_all(states)]
    return _merge_all(states)


def _read_pages(q, cache: _Cache, pages, far_page: int, end: int, scale: float, read_dtype, rope=None,
               softcap: float = 0.0, alpha: float = 1.0):
    """Attention of ``q [Hkv, M, d]`` (work dtype) over the entries of ``pages [Hkv, K]`` (page t = entries
    ``[t P, (t + 1) P)``, every entry valid, below ``end`` and seen by every row; each KV head its own), read
    :data:`CHUNK_BYTES` of keys at a time; with ``rope`` each key is first un-rotated by its position.
    Keys and values are read in ``read_dtype``. Returns ``(o, lse)`` in q's dtype."""
    heads_kv, head_dim = cache.k.shape[-2], cache.k.shape[-1]
    per_step = max(1, CHUNK_BYTES // (heads_kv * head_dim * 4 * far_page))                # pages per chunk
    q_in = q.to(read_dtype)
    offsets = torch.arange(far_page, device=q.device)
    states = []
    for p0 in range(0, pages.shape[1], per_step):
        j = (pages[:, p0:p0 + per_step, None].long() * far_page + offsets).flatten(1)     # [Hkv, N]
        k, v = cache.take_heads(j)                                                          # [Hkv, N, d]
        if rope is not None:                    # R_{-j} of each key: the kept tables of j, gathered
            cos, sin = rope.cos_sin(0, end, dtype=q.dtype, device=q.device)
            k = rotate_with(k.to(q.dtype), cos[j], sin[j], rope, inverse=True)
        o, lse = _fused_read(q_in, k.to(read_dtype).contiguous(), v.to(read_dtype).contiguous(), scale, softcap,
                             alpha)
        states.append((o.to(q.dtype), lse.to(q.dtype)))
        if len(states) == MERGE_STATES:
            states = [_merge_all(states)]
    return _merge_all(states)


def _rotate_rows(qm, start, rope, factor, per_row=True):
    """``qm [Hkv, n_q, group, d]`` (work dtype) rotated at ``start + r`` for row r (``start`` for every
    row without ``per_row``) with ``factor`` -> ``[Hkv, n_q * group, d]``; tables from :meth:`Rope.cos_sin`."""
    n_q = qm.shape[1]
    cos, sin = rope.cos_sin(start, n_q if per_row else 1, dtype=qm.dtype, device=qm.device)   # [n_q or 1, half]
    return rotate_with(qm, (cos * factor)[:, None], (sin * factor)[:, None], rope).flatten(1, 2)


def _scale_rotary(qm, rope, factor):
    """``qm [..., d]`` with its rotary dims times ``factor`` (the rotation by 0): no table, no copy at 1."""
    if factor == 1.0:
        return qm
    out = qm.clone()
    dims = slice(0, rope.rotary_dim)
    out[..., dims] *= factor
    return out


def _far_queries(qm, rope, factor, far_start, n, queries_rotated, far_per_row):
    """The far branch's queries ``[Hkv, n_q * group, d]`` from ``qm [Hkv, n_q, group, d]``: at ``far_start + r``
    (``far_start`` for every row without ``far_per_row``: ReRoPE's rule); queries that arrive rotated at
    ``n + r`` are turned by the difference."""
    if not queries_rotated:
        return _rotate_rows(qm, far_start, rope, factor, per_row=far_per_row)
    if far_per_row:                                          # turn by D + r - (n + r): one angle for every row
        return _rotate_rows(qm, far_start - n, rope, factor, per_row=False)
    turn = far_start - n - torch.arange(qm.shape[1], device=qm.device)
    return rotate(qm.transpose(1, 2), turn, rope, factor=factor).transpose(1, 2).flatten(1, 2)


def _pack(x, heads_kv):
    # [n, Hq, d] -> [Hkv, n * group, d]: row m = r * group + h
    n, heads_q, head_dim = x.shape
    return x.view(n, heads_kv, heads_q // heads_kv, head_dim).transpose(0, 1).reshape(heads_kv, -1, head_dim)


def _unpack(x, n):
    # [Hkv, n * group, ...] -> [n, Hq, ...]
    heads_kv, rows = x.shape[:2]
    return x.reshape(heads_kv, n, rows // n, *x.shape[2:]).transpose(0, 1).reshape(n, heads_kv * (rows // n),
                                                                                   *x.shape[2:])


@_serial_on_cpu
def fold_attention_torch(q, k, v, rope, cache_seqlens, *, window, alpha, softmax_scale, keys_rotated, return_lse,
                         block_table=None, far_per_row=True, queries_rotated=False, read_far=True,
                         sliding_window=None, causal=False, k_scale=1.0, v_scale=1.0, far_pages=None, far_page=0,
                         softcap=0.0):
    """Same contract as the Triton launcher: validated inputs in, ``(out, lse or None)`` out.

    ``k, v`` are ``[batch, max_len, Hkv, d]``, or pages ``[num_blocks, page_size, Hkv, d]`` with
    ``block_table [batch, max_blocks]``, in q's dtype or FP8 (read as ``k * k_scale``, ``v * v_scale``).
    ``far_per_row=False`` reads every far entry at distance ``D`` from every row instead of ``D + r``
    (ReRoPE's rule); ``read_far=False`` reads the local branch alone. ``sliding_window`` (``Ws``):
    the local branch is ``p - j < Ws`` instead of ``p - j < D``; ``causal``: row r does not see the
    block's entries after its own. ``queries_rotated``: ``q`` holds ``R_{n+r} q``; the window reads it
    as it is and the far branch turns it on by the difference of the two positions. ``far_pages
    [B, Hkv, K]`` (int32, ascending, -1 padded; :func:`fold.far_pages.select_pages`): a budgeted far read
    of those pages of ``far_page`` entries; a sequence whose far memory has at most K pages reads it all,
    by the full read's code (so exactly FOLD). ``softcap > 0``: each logit ``x = q.k * scale`` is
    ``softcap * tanh(x / softcap)`` before the far branch's alpha (no fused CPU read: explicit chunks).

    Every segment's state is kept in the work dtype (float32 for half inputs: a half cache is read a
    chunk at a time in float32) until the one final rounding to q's dtype.

    Per sequence (``span = Ws`` or ``D``, ``win_lo = n - span + 1``, ``far_hi = win_lo + n_q - 1``)::

        [0, win_lo)        far for every row            -> fused reads (alpha * scale)
        [win_lo, far_hi)   n_q - 1 mixed entries        -> explicit logits under a per-row mask, both branches
        [far_hi, n)        local for every row          -> fused reads at exact positions
        [n, L)             the block (causal: per row)  -> explicit logits, with the mixed entries

    With a budget (``P = far_page``, ``s0 = win_lo // P``): the pages below ``s0`` are the candidates,
    and the first ``min(K - straddlers, s0)`` listed pages of each KV head are those selected (the list is
    ascending; the straddling pages ``s0 ..`` are always in it): gathered per head, then ``[s0 P, win_lo)``
    and the mixed entries as above.
    """
    batch, n_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    work = work_dtype(q.dtype)
    seqlens = [k.shape[1]] * batch if cache_seqlens is None else cache_seqlens.tolist()
    f = rope.attention_factor
    # R_0 k = f k on the rotary dims, and the window's R_j k carries f too: q takes its own factor unless
    # it arrives rotated, and the key's unless the cache already holds it (un-rotating is pure)
    q_factor = (1.0 if queries_rotated else f) * (1.0 if keys_rotated else f)
    span = window + n_q if sliding_window is None else sliding_window
    scale = softmax_scale * k_scale                                  # an FP8 cache holds k / k_scale
    row_r = torch.arange(n_q, device=q.device).repeat_interleave(heads_q // heads_kv)   # [M] row m = r * group + h
    out = torch.empty_like(q)
    lse_out = torch.empty(batch, n_q, heads_q, device=q.device, dtype=work) if return_lse else None
    for b, length in enumerate(seqlens):
        if length < n_q:            # no entries (a CUDA graph's padding request, unchecked): (0, -inf) as the kernels
            out[b] = 0
            if return_lse:
                lse_out[b] = float("-inf")
            continue
        cache = _Cache(k, v, b, block_table)
        n = length - n_q
        win_lo = n - span + 1
        a, c = max(0, win_lo), max(0, win_lo + n_q - 1)
        qm = _pack(q[b], heads_kv).to(work).view(heads_kv, n_q, -1, head_dim)        # [Hkv, n_q, group, d]
        if queries_rotated:          # already at n + r: only the factors (a pure scaling, no table)
            q_win = _scale_rotary(qm, rope, q_factor).flatten(1, 2)
        else:
            q_win = _rotate_rows(qm, n, rope, q_factor)                              # rows at n + r

        # the explicit entries: the mixed ones [a, c) and the block's own [n, L)
        j = torch.cat([torch.arange(a, c, device=q.device), torch.arange(n, length, device=q.device)])
        ke, ve = cache.take(j)
        ke, ve = ke.transpose(0, 1).to(work), ve.transpose(0, 1).to(work)            # [Hkv, E, d]
        behind = (n + row_r)[:, None] - j[None, :]                                   # p - j, [M, E]
        local = (behind < span) & (behind >= 0) if causal else behind < span
        k_local = ke if keys_rotated else rotate(ke, j, rope, factor=1.0)
        win = merge_pair(*_read(q_win, cache, c, n, scale, work, *(() if keys_rotated else (rope, False)),
                                softcap=softcap),
                         *masked_attention(q_win, k_local, ve, local, scale, softcap=softcap))
        if read_far and c > 0:
            q_far = _far_queries(qm, rope, q_factor, window + n_q, n, queries_rotated, far_per_row)
            far_rope = (rope, True) if keys_rotated else ()
            logits = dict(softcap=softcap, alpha=alpha)
            if far_pages is not None and -(-c // far_page) > far_pages.shape[-1]:          # the budget binds
                s0 = a // far_page
                chosen = min(far_pages.shape[-1] - (-(-c // far_page) - s0), s0)           # candidates read
                far = _read(q_far, cache, s0 * far_page, a, scale, work, *far_rope, **logits)
                if chosen:
                    picked = _read_pages(q_far, cache, far_pages[b, :, :chosen], far_page, s0 * far_page,
                                         scale, work, rope if keys_rotated else None, **logits)
                    far = merge_pair(*far, *picked)
            else:
                far = _read(q_far, cache, 0, a, scale, work, *far_rope, **logits)
            if c > a:                                                                # the mixed entries' far part
                k_far = rotate(ke, -j, rope, factor=1.0) if keys_rotated else ke
                far = merge_pair(*far, *masked_attention(q_far, k_far, ve, behind >= span, scale, **logits))
            o, lse = merge_pair(*win, far[0], far[1] / alpha)                          # [Hkv, M, d], [Hkv, M]
        else:
            o, lse = win
        out[b] = _unpack(o * v_scale, n_q)
        if return_lse:
            lse_out[b] = _unpack(lse, n_q)
    return out, lse_out


@_serial_on_cpu
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
        cached = _read(qm, _Cache(k_cache, v_cache, b, block_table), 0, length, softmax_scale, q.dtype)
        tree = masked_attention(qm, k_tree[b].transpose(0, 1).to(work), v_tree[b].transpose(0, 1).to(work),
                                tree_mask[b][node], softmax_scale)
        o, lse = merge_pair(*cached, *tree)
        out[b] = _unpack(o, n_tree)
        if return_lse:
            lse_out[b] = _unpack(lse, n_tree)
    return out, lse_out
