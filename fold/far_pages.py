"""``fold.far_pages``: per-page key bounds, so a budgeted FOLD read (``fold.attention(..., far_budget=N)``)
reads only the far pages whose logits can matter.

FOLD reads every far entry at one shared position with unrotated keys ``R_0 k``, so a bound on a far
logit over a page of keys depends only on that page's keys. For each page (``far_page`` entries,
page ``t`` = entries ``[t P, (t + 1) P)``) and KV head this module keeps the elementwise max and min of
the page's keys (Quest's bound)::

    bounds[..., 0, :] = max over the page's keys,  bounds[..., 1, :] = min      (float32)
    q . k <= sum_i max(q_i * max_i, q_i * min_i)     for every key k of the page

The keys are the unrotated, dequantized keys (``k * k_scale``; for a cache that stores ``R_j k_j`` the
keys un-rotated at ``j``, without the rotary ``attention_factor``). A page with nothing written holds
``(-inf, +inf)``. Layouts::

    dense cache [batch, max_len, Hkv, d]        -> bounds [batch, ceil(max_len / P), Hkv, 2, d]
    paged cache [num_blocks, P, Hkv, d]         -> bounds [num_blocks, Hkv, 2, d]   (by physical block)

The index is append-only: :func:`update_bounds` folds each written chunk in place (no host sync, CUDA
graph safe); :func:`page_bounds` builds it from scratch (what ``far_bounds=None`` does, ``O(L)`` a call).
:func:`select_pages` is the selection rule, the one implementation the torch path and the Triton
launcher share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fold.checks import check_bool, check_float
from fold.read_options import RANKS, ReadOptions, straddled_pages
from fold.rope import Rope, rotate_with, work_dtype

__all__ = ["RANKS", "KeyCache", "empty_bounds", "page_bounds", "select_pages", "straddled_pages", "update_bounds"]

# entries of keys turned into float32 per step of page_bounds (memory O(chunk) at any length)
BOUNDS_CHUNK = 1 << 16
# rows of keys (one entry of one KV head; every sequence and head together) turned into float32 and
# scored per step of rank="keys": 8 MiB of float32 keys at d = 128, so a step's keys stay in cache
KEYS_CHUNK = 1 << 14
# the selection's two levels (:func:`select_pages`): pages per group, and groups ranked page by page
GROUP_PAGES = 16
SHORTLIST_PER_SLOT, SHORTLIST_MIN = 2, 16


def empty_bounds(num_pages: int, heads_kv: int, head_dim: int, *, batch: int | None = None,
                 device=None) -> torch.Tensor:
    """Bounds of pages with nothing written: ``(-inf, +inf)``.

    Returns ``[batch, num_pages, heads_kv, 2, head_dim]`` float32 with ``batch`` (a dense cache), else
    ``[num_pages, heads_kv, 2, head_dim]`` (a paged cache: ``num_pages = num_blocks``).
    """
    lead = (num_pages,) if batch is None else (batch, num_pages)
    out = torch.empty(*lead, heads_kv, 2, head_dim, dtype=torch.float32, device=device)
    out[..., 0, :] = float("-inf")
    out[..., 1, :] = float("inf")
    return out


def _unrotated(keys: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``keys [..., Hkv, d]`` float32 stored as ``R_j k`` (factor included) at ``positions [...]`` -> ``k``."""
    angle = positions.to(torch.float64)[..., None, None] * rope.inv_freq_on(keys.device).double()   # [..., 1, half]
    f = rope.attention_factor
    return rotate_with(keys, (torch.cos(angle) / f).to(keys.dtype), (torch.sin(angle) / f).to(keys.dtype), rope,
                       inverse=True)


def _keys_for_bounds(keys, positions, keys_rotated, rope, k_scale):
    """Stored keys ``[..., Hkv, d]`` (any float dtype, FP8 included) -> the unrotated dequantized keys, float32
    (contiguous, whatever the strides of ``keys``)."""
    x = torch.empty(keys.shape, dtype=torch.float32, device=keys.device).copy_(keys)
    if k_scale != 1.0:
        x = x * k_scale
    if keys_rotated:
        if rope is None:
            raise ValueError("keys_rotated=True needs rope (the keys are un-rotated before their bounds are taken)")
        x = _unrotated(x, positions, rope)
    return x


def _check_common(name, keys, far_page, keys_rotated, rope, k_scale):
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(keys).__name__}")
    ReadOptions.check("far_page", far_page)
    check_bool("keys_rotated", keys_rotated)
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope must be a fold.Rope or None, got {type(rope).__name__}")
    if keys_rotated and rope is None:
        raise ValueError("keys_rotated=True needs rope (the keys are un-rotated before their bounds are taken)")
    check_float("k_scale", k_scale, 0, open_low=True)


def page_bounds(k: torch.Tensor, far_page: int, *, cache_seqlens=None, block_table=None, keys_rotated: bool = False,
                rope: Rope | None = None, k_scale: float = 1.0) -> torch.Tensor:
    """The bounds of every page of a cache, built from scratch (``O(L)``; keys read ``BOUNDS_CHUNK`` at a time).

    Args:
        k: dense ``[batch, max_len, Hkv, d]``, or pages ``[num_blocks, far_page, Hkv, d]`` with ``block_table``.
        far_page: P, entries per page (with ``block_table``: the cache's page size).
        cache_seqlens: [batch] valid lengths (entries at and beyond are not written). Default: ``max_len``.
            Required with ``block_table``.
        block_table: [batch, max_blocks] int32; only the pages holding entries ``< cache_seqlens[b]`` are
            read (other entries may be garbage).
        keys_rotated: ``k`` holds ``R_j k_j``; the bounds are of ``k_j`` (needs ``rope``).
        k_scale: the cache holds ``k / k_scale`` (FP8); the bounds are of ``k``.

    Returns:
        dense ``[batch, ceil(max_len / P), Hkv, 2, d]``, paged ``[num_blocks, Hkv, 2, d]`` float32.
    """
    _check_common("k", k, far_page, keys_rotated, rope, k_scale)
    if k.ndim != 4:
        raise ValueError(f"k must have 4 dims, got {tuple(k.shape)}")
    if block_table is not None:
        return _paged_bounds(k, far_page, cache_seqlens, block_table, keys_rotated, rope, k_scale)
    batch, max_len, heads_kv, head_dim = k.shape
    num_pages = -(-max_len // far_page)
    lengths = (torch.full((batch,), max_len, device=k.device) if cache_seqlens is None
               else torch.as_tensor(cache_seqlens, device=k.device)).long()
    out = torch.empty(batch, num_pages, heads_kv, 2, head_dim, dtype=torch.float32, device=k.device)
    step = max(1, BOUNDS_CHUNK // far_page)                                              # pages per step
    for p0 in range(0, num_pages, step):
        p1 = min(p0 + step, num_pages)
        e0, e1 = p0 * far_page, min(p1 * far_page, max_len)
        j = torch.arange(e0, p1 * far_page, device=k.device)                           # padded to whole pages
        x = _keys_for_bounds(k[:, e0:e1], j[:e1 - e0], keys_rotated, rope, k_scale)    # [B, N, Hkv, d]
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, p1 * far_page - e1))
        written = (j[None, :] < lengths[:, None])[:, :, None, None]                    # [B, N, 1, 1]
        x = x.view(batch, p1 - p0, far_page, heads_kv, head_dim)
        written = written.view(batch, p1 - p0, far_page, 1, 1)
        out[:, p0:p1, :, 0] = torch.where(written, x, float("-inf")).amax(2)
        out[:, p0:p1, :, 1] = torch.where(written, x, float("inf")).amin(2)
    return out


def _paged_bounds(k, far_page, cache_seqlens, block_table, keys_rotated, rope, k_scale):
    num_blocks, page_size, heads_kv, head_dim = k.shape
    if page_size != far_page:
        raise ValueError(f"far_page={far_page} must equal the cache's page size k.shape[1]={page_size}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required with block_table (the pages hold no length)")
    lengths = torch.as_tensor(cache_seqlens, device=k.device).long()
    t = torch.arange(block_table.shape[1], device=k.device)
    written = (lengths[:, None] - t[None, :] * far_page).clamp(0, far_page)          # [B, max_blocks] slots
    used = written > 0
    block = torch.where(used, block_table.long(), num_blocks).flatten()              # unused -> a spare row
    count = torch.zeros(num_blocks + 1, dtype=torch.long, device=k.device)
    count.scatter_reduce_(0, block, written.flatten(), "amax")
    start = torch.zeros(num_blocks + 1, dtype=torch.long, device=k.device)             # the block's first position
    start.scatter_reduce_(0, block, (t * far_page).expand_as(written).flatten(), "amax")
    out = torch.empty(num_blocks, heads_kv, 2, head_dim, dtype=torch.float32, device=k.device)
    step = max(1, BOUNDS_CHUNK // far_page)
    slot = torch.arange(far_page, device=k.device)
    for b0 in range(0, num_blocks, step):
        b1 = min(b0 + step, num_blocks)
        x = _keys_for_bounds(k[b0:b1], start[b0:b1, None] + slot, keys_rotated, rope, k_scale)   # [n, P, Hkv, d]
        mask = (slot[None, :] < count[b0:b1, None])[:, :, None, None]
        out[b0:b1, :, 0] = torch.where(mask, x, float("-inf")).amax(1)
        out[b0:b1, :, 1] = torch.where(mask, x, float("inf")).amin(1)
    return out


def update_bounds(bounds: torch.Tensor, keys: torch.Tensor, *, far_page: int, positions=None, slot_mapping=None,
                  batch_index=None, keys_rotated: bool = False, rope: Rope | None = None,
                  k_scale: float = 1.0) -> None:
    """Fold keys just written to the cache into ``bounds``, in place (torch ops only: no host sync).

    A write at offset 0 of a page resets that page first (engines reuse pages), then every page's max
    and min take the new keys. Negative slots (dense: negative positions) are skipped, as vLLM pads
    ``slot_mapping``.

    Args:
        bounds: dense ``[batch, num_pages, Hkv, 2, d]`` or paged ``[num_blocks, Hkv, 2, d]`` float32.
        keys: [T, Hkv, d] the written keys, as the cache stores them (any float dtype, FP8 included).
        far_page: P.
        positions: [T] int, the keys' positions in their sequence: dense caches (required), and paged
            ones with ``keys_rotated`` (to un-rotate them).
        slot_mapping: [T] int, paged caches: slot ``block * P + offset``.
        batch_index: [T] int, dense caches: the sequence each key belongs to.
        keys_rotated: ``keys`` are ``R_j k_j`` at ``positions`` (needs ``rope``).
        k_scale: the cache holds ``k / k_scale``.
    """
    _check_common("keys", keys, far_page, keys_rotated, rope, k_scale)
    if not isinstance(bounds, torch.Tensor) or bounds.dtype != torch.float32:
        raise TypeError("bounds must be a float32 tensor (see fold.far_pages.empty_bounds)")
    paged = slot_mapping is not None
    if bounds.ndim != (4 if paged else 5) or bounds.shape[-2] != 2:
        want = "[num_blocks, Hkv, 2, d] (with slot_mapping)" if paged else "[batch, num_pages, Hkv, 2, d]"
        raise ValueError(f"bounds must have shape {want}, got {tuple(bounds.shape)}")
    if keys.ndim != 3 or keys.shape[1:] != (bounds.shape[-3], bounds.shape[-1]):
        raise ValueError(f"keys must have shape [T, Hkv={bounds.shape[-3]}, d={bounds.shape[-1]}], "
                         f"got {tuple(keys.shape)}")
    if paged:
        slots = torch.as_tensor(slot_mapping, device=keys.device).long()
        if keys_rotated and positions is None:
            raise ValueError("keys_rotated=True with slot_mapping needs positions= (to un-rotate the keys)")
        pos = slots if positions is None else torch.as_tensor(positions, device=keys.device).long()
        valid = slots >= 0
        row, offset = slots.clamp(min=0) // far_page, slots.clamp(min=0) % far_page
        flat = bounds
    else:
        if positions is None or batch_index is None:
            raise ValueError("a dense bounds tensor needs positions= and batch_index= (or pass slot_mapping=)")
        pos = torch.as_tensor(positions, device=keys.device).long()
        b = torch.as_tensor(batch_index, device=keys.device).long()
        valid = pos >= 0
        num_pages = bounds.shape[1]
        row = b * num_pages + pos.clamp(min=0) // far_page
        offset = pos.clamp(min=0) % far_page
        flat = bounds.view(-1, *bounds.shape[2:])                                    # [batch * num_pages, ...]
    for name, x in (("positions", pos), ("slot_mapping" if paged else "batch_index", row)):
        if x.shape != keys.shape[:1]:
            raise ValueError(f"{name} must have shape [T={keys.shape[0]}], got {tuple(x.shape)}")
    row = torch.where(valid, row, 0)
    # reset every page written at offset 0 (all its keys of this chunk agree on it, so the writes agree)
    reset = torch.zeros(flat.shape[0], dtype=torch.int32, device=keys.device)
    reset.index_put_((row,), (valid & (offset == 0)).int(), accumulate=True)
    empty = torch.full((2, 1), float("inf"), device=keys.device)              # [2, 1]: (-inf, +inf); no host copy
    empty[0] = float("-inf")
    flat.index_put_((row,), torch.where(reset[row][:, None, None, None] > 0, empty, flat[row]))
    x = _keys_for_bounds(keys, pos, keys_rotated, rope, k_scale)                              # [T, Hkv, d]
    m = valid[:, None, None]
    index = row[:, None, None].expand_as(x)
    flat.select(-2, 0).scatter_reduce_(0, index, torch.where(m, x, float("-inf")), "amax")
    flat.select(-2, 1).scatter_reduce_(0, index, torch.where(m, x, float("inf")), "amin")


def far_queries(q: torch.Tensor, rope: Rope, cache_seqlens, *, window: int, max_len: int,
                queries_rotated: bool) -> torch.Tensor:
    """The block's queries turned to FOLD's far position, as the selection scores them (no host sync).

    ``q [batch, n_q, Hq, d]`` (before RoPE, or ``R_{n+r} q`` with ``queries_rotated``; ``cache_seqlens [batch]``
    or None for ``max_len`` gives ``n``) -> ``[batch, n_q, Hq, d]`` in the work dtype: row r rotated to
    ``D + r`` (``D = window + n_q``), the rotary dims times the query's factor and the key's (the bounds
    are of ``k``; the far branch reads ``R_0 k = f k``).
    """
    batch, n_q = q.shape[:2]
    work = work_dtype(q.dtype)
    r = torch.arange(n_q, device=q.device)
    pos = (window + n_q + r)[None, :].expand(batch, n_q)
    f = rope.attention_factor
    factor = f if queries_rotated else f * f
    if queries_rotated:                              # q at n + r: turn by D + r - (n + r)
        lengths = (torch.full((batch,), max_len, device=q.device) if cache_seqlens is None
                   else cache_seqlens.to(q.device)).long()
        pos = pos - (lengths[:, None] - n_q + r[None, :])
    angle = pos.to(torch.float64)[:, :, None, None] * rope.inv_freq_on(q.device).double()     # [B, n_q, 1, half]
    return rotate_with(q.to(work), (torch.cos(angle) * factor).to(work), (torch.sin(angle) * factor).to(work), rope)


def shortlist_size(num_slots: int) -> int:
    """Groups of :data:`GROUP_PAGES` pages whose pages the selection ranks one by one (:func:`select_pages`):
    ``max(2 K, 16)``, so ranking costs one group bound per ``GROUP_PAGES`` pages plus ``O(K)`` page bounds."""
    return max(SHORTLIST_PER_SLOT * num_slots, SHORTLIST_MIN)


def _group_bound(q_pos, q_neg, hi, lo, scale):
    """The exact bound of query rows ``q [B, Hkv, M, d]`` (as its positive and negative parts) against
    boxes ``hi, lo [B, Hkv, C, d]`` -> ``[B, Hkv, C]``: ``scale * max_m sum_i max(q_i hi_i, q_i lo_i)``;
    NaN -> +inf (read), an empty box -> -inf."""
    s = (torch.einsum("bhmd,bhcd->bhmc", q_pos, hi) + torch.einsum("bhmd,bhcd->bhmc", q_neg, lo)).amax(2) * scale
    s = torch.where(torch.isnan(s), float("inf"), s)
    return torch.where((hi < lo).any(-1), float("-inf"), s)


@dataclass(frozen=True)
class KeyCache:
    """The cache a selection reads, as stored: ``k`` dense ``[batch, max_len, Hkv, d]``, or pages
    ``[num_blocks, P, Hkv, d]`` with ``block_table [batch, max_blocks]`` int32; ``cache_seqlens [batch]``
    int tensor, or None (every sequence holds ``max_len``); ``keys_rotated``, ``rope``, ``k_scale`` as
    :func:`page_bounds` takes them."""

    k: torch.Tensor
    cache_seqlens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    keys_rotated: bool = False
    rope: Rope | None = None
    k_scale: float = 1.0

    @property
    def max_len(self) -> int:
        return self.k.shape[1] * (1 if self.block_table is None else self.block_table.shape[1])

    def lengths(self) -> torch.Tensor:
        """``[batch]`` int64 valid lengths."""
        if self.cache_seqlens is None:
            batch = self.k.shape[0] if self.block_table is None else self.block_table.shape[0]
            return torch.full((batch,), self.max_len, device=self.k.device)
        return self.cache_seqlens.to(self.k.device).long()


def select_pages(q_far: torch.Tensor, bounds: torch.Tensor, cache: KeyCache, *, span: int, far_page: int,
                 num_slots: int, scale: float, rank: str = "bound") -> torch.Tensor:
    """The pages a budgeted far read reads, per sequence and KV head (torch ops: no host sync).

    Row r of sequence b (``L`` entries, ``n = L - n_q``) reads entry j as far memory iff ``j <= n + r - span``
    (``span = window + n_q``, or a sliding layer's window). Per page t:

    - straddlers (an entry far for some row but not for every row, or a page that also holds entries
      that are not far) are always read;
    - candidates (every entry far for every row: ``(t + 1) P <= n - span + 1``) are ranked by
      ``bound(t) = scale * max over rows and the group's heads of sum_i max(q~_i max_i, q~_i min_i)``, ties
      towards the lower page (stable sorts), and the top ``num_slots - #straddlers`` are read. A NaN
      bound ranks as ``+inf`` (a page that cannot be bounded is read); an empty page as ``-inf``.

    Ranking is two-level, so that its cost does not follow the context at the page's grain: consecutive
    pages form groups of :data:`GROUP_PAGES` (group ``g`` = pages ``[g G, (g + 1) G)``), each group's box
    is the elementwise max / min of its pages' boxes, and its bound (the same formula) is at least each
    of its pages' bounds. The :func:`shortlist_size` groups with the highest bounds (among groups holding
    a candidate; ties towards the lower group) have their candidate pages ranked as above. With no more
    groups than that, every candidate is ranked: the pages read are the top ones by bound exactly, and
    in general whenever the K-th bound read is at least the best bound of a group left out.

    ``rank="keys"`` ranks the listed candidates by their keys instead of their boxes: for each row and
    head of the group, every listed candidate's largest far logit ``scale * max_j q~ . k_j`` turned into a
    share over the listed candidates (a softmax), and those shares averaged over rows and heads. It reads
    the keys of the listed pages (at most ``shortlist_size(K) * GROUP_PAGES`` pages, whatever the length)
    and computes their logits: a bounded cost that pays when a drafter's far mass sits in single entries,
    which a page's box does not show (``docs/far-budget.md``). Groups are still listed by their boxes.

    Args:
        q_far: [batch, n_q, Hq, d] from :func:`far_queries`.
        bounds: dense ``[batch, >= ceil(max_len / P), Hkv, 2, d]``, or paged ``[num_blocks, Hkv, 2, d]``
            (with ``cache.block_table``).
        cache: the cache's keys (read with ``rank="keys"``), its block table and lengths.
        num_slots: K, pages read per sequence and KV head (>= :func:`straddled_pages`).
        scale: ``softmax_scale * alpha`` (positive).
        rank: ``"bound"`` (default) or ``"keys"``.

    Returns:
        [batch, Hkv, K] int32 page indices (logical: page t = entries ``[t P, (t + 1) P)``), ascending,
        then -1.
    """
    batch, n_q, heads_q, head_dim = q_far.shape
    heads_kv = bounds.shape[-3]
    block_table = cache.block_table
    num_pages = block_table.shape[1] if block_table is not None else -(-cache.max_len // far_page)
    q = q_far.view(batch, n_q, heads_kv, heads_q // heads_kv, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(batch, heads_kv, -1, head_dim).float()                                 # [B, Hkv, M, d]
    q_pos, q_neg = q.clamp(min=0), q.clamp(max=0)
    dev = q.device
    G = GROUP_PAGES
    num_groups = -(-num_pages // G)
    win_lo = (cache.lengths() - n_q - span + 1)[:, None, None]  # [B, 1, 1] entries < win_lo are far for every row
    far_hi = win_lo + n_q - 1                                   # entries < far_hi are far for some row
    if num_groups <= shortlist_size(num_slots):                 # every group is listed: rank every page
        among = torch.arange(num_pages, device=dev).expand(batch, heads_kv, num_pages)
        if rank == "keys":
            score = _key_shares(q, among, cache, win_lo, far_page, num_pages, scale, every_page=True)
        else:
            score = _page_scores(q_pos, q_neg, bounds, block_table, far_page, num_pages, scale)
        return _read_best(among, score, win_lo, far_hi, far_page, num_pages, num_slots)
    group_score = torch.empty(batch, heads_kv, num_groups, dtype=torch.float32, device=dev)
    step = max(1, BOUNDS_CHUNK // (far_page * G))                                      # groups per step
    for g0 in range(0, num_groups, step):
        g1 = min(g0 + step, num_groups)
        t0, t1 = g0 * G, min(g1 * G, num_pages)
        if block_table is None:
            page = bounds[:, t0:t1]                                                      # [B, T', Hkv, 2, d]
        else:
            page = bounds[block_table[:, t0:t1].long().clamp(0, bounds.shape[0] - 1)]
        whole = (t1 - t0) // G                          # groups of G pages here; a last one may hold fewer
        his, los = [], []
        if whole:
            v = page[:, :whole * G].unflatten(1, (whole, G))                             # a view: [B, G', G, Hkv, 2, d]
            his.append(v[..., 0, :].amax(2))
            los.append(v[..., 1, :].amin(2))
        if whole * G < t1 - t0:
            his.append(page[:, whole * G:, :, 0].amax(1, keepdim=True))
            los.append(page[:, whole * G:, :, 1].amin(1, keepdim=True))
        hi, lo = (torch.cat(x, 1).float().transpose(1, 2) for x in (his, los))         # [B, Hkv, G', d]
        group_score[:, :, g0:g1] = _group_bound(q_pos, q_neg, hi, lo, scale)
    # groups holding a candidate (candidates are a prefix of the pages: the group's first page is one)
    g = torch.arange(num_groups, device=dev)
    has_candidate = (g * G + 1) * far_page <= win_lo                                     # [B, 1, num_groups]
    key = torch.where(has_candidate, group_score, float("-inf"))
    groups = torch.sort(-key, dim=-1, stable=True).indices[..., :shortlist_size(num_slots)]   # [B, Hkv, S]
    listed = (groups[..., None] * G + torch.arange(G, device=dev)).flatten(2)          # [B, Hkv, S G]
    first = torch.div(win_lo.clamp(min=0), far_page, rounding_mode="floor")           # the first straddler
    max_straddlers = straddled_pages(n_q, far_page)
    strad_pages = (first + torch.arange(max_straddlers, device=dev)).expand(batch, heads_kv, max_straddlers)
    among = torch.sort(torch.cat([listed, strad_pages], dim=-1), dim=-1).values        # ascending: ties -> lower page
    if rank == "keys":
        score = _key_shares(q, among, cache, win_lo, far_page, num_pages, scale)
    else:
        hi, lo = _boxes(bounds, block_table, among.clamp(max=num_pages - 1))
        score = _group_bound(q_pos, q_neg, hi, lo, scale)
    return _read_best(among, score, win_lo, far_hi, far_page, num_pages, num_slots)


def _boxes(bounds, block_table, t):
    """The boxes of pages ``t [B, Hkv, C]`` (in range) -> ``hi, lo [B, Hkv, C, d]`` float32."""
    batch, heads_kv = t.shape[:2]
    h = torch.arange(heads_kv, device=t.device)[None, :, None]
    if block_table is None:
        page = bounds[torch.arange(batch, device=t.device)[:, None, None], t, h]
    else:
        phys = block_table.long().gather(1, t.flatten(1)).view_as(t).clamp(0, bounds.shape[0] - 1)
        page = bounds[phys, h]
    return page[..., 0, :].float(), page[..., 1, :].float()


def _page_scores(q_pos, q_neg, bounds, block_table, far_page, num_pages, scale):
    """Every page's bound ``[B, Hkv, num_pages]``, from the pages' boxes as stored (no gather)."""
    batch, heads_kv = q_pos.shape[:2]
    score = torch.empty(batch, heads_kv, num_pages, dtype=torch.float32, device=q_pos.device)
    step = max(1, BOUNDS_CHUNK // far_page)
    for t0 in range(0, num_pages, step):
        t1 = min(t0 + step, num_pages)
        page = (bounds[:, t0:t1] if block_table is None
                else bounds[block_table[:, t0:t1].long().clamp(0, bounds.shape[0] - 1)])   # [B, T', Hkv, 2, d]
        hi, lo = (page[..., i, :].float().transpose(1, 2) for i in (0, 1))             # [B, Hkv, T', d]
        score[:, :, t0:t1] = _group_bound(q_pos, q_neg, hi, lo, scale)
    return score


def _entry_rows(keys: torch.Tensor):
    """Keys ``[A, B, Hkv, d]`` (dense ``[batch, max_len, Hkv, d]`` or pages ``[num_blocks, P, Hkv, d]``) ->
    ``(rows, strides)``: a view ``rows [N, d]`` of their storage, one key of one head a row, and the
    leading dims' strides counted in rows, so that ``keys[i, j, h] == rows[i s0 + j s1 + h s2]``. Works
    for any cache whose keys are unit-stride rows on a grid of ``d`` elements (a contiguous cache, or a
    view such as vLLM's K half of a joint K/V tensor); else ``(None, (0, 0, 0))`` (the caller indexes)."""
    d = keys.shape[-1]
    strides = [s if n > 1 else 0 for n, s in zip(keys.shape[:-1], keys.stride()[:-1])]
    if keys.stride(-1) != 1 or any(s % d or s < 0 for s in strides):
        return None, (0, 0, 0)
    strides = [s // d for s in strides]
    n_rows = sum((n - 1) * s for n, s in zip(keys.shape[:-1], strides)) + 1
    return torch.as_strided(keys, (n_rows, d), (d, 1)), tuple(strides)


def _key_shares(q, among, cache: KeyCache, win_lo, far_page, num_pages, scale, every_page=False):
    """``rank="keys"``: pages ``among [B, Hkv, C]`` -> each candidate's mean share ``[B, Hkv, C]`` over rows and
    heads ``q [B, Hkv, M, d]`` of ``softmax over candidates (scale * the page's largest far logit)``; -inf for
    pages that are not candidates. Keys are read about ``KEYS_CHUNK`` rows at a time (all sequences and
    heads), each step's keys gathered head by head into ``[B, Hkv, entries, d]`` order, turned into float32
    and multiplied while they are in cache; ``every_page`` (``among`` is every page, for every head) reads
    them as slices, without a gather. On a CPU the steps run on the selection's one thread
    (:func:`fold.torch_path.serial_on_cpu`): each step is a few milliseconds of work, and a parallel
    region per op would wait for a descheduled thread on a busy host (``docs/far-budget.md``)."""
    batch, heads_kv, m, head_dim = q.shape
    keys, block_table = cache.k, cache.block_table
    C = among.shape[-1]
    dev = q.device
    t = among.clamp(max=num_pages - 1)
    candidate = (among < num_pages) & ((t + 1) * far_page <= win_lo)                    # whole pages, all far
    top = torch.empty(batch, heads_kv, m, C, dtype=torch.float32, device=dev)
    h = torch.arange(heads_kv, device=dev)[None, :, None, None]
    slot = torch.arange(far_page, device=dev)
    step = max(1, KEYS_CHUNK // (batch * heads_kv * far_page))                          # pages per step
    rows, (s0, s1, s2) = _entry_rows(keys)

    for c0 in range(0, C, step):
        c1 = min(c0 + step, C)
        if every_page:                                  # pages c0..c1 of every sequence
            pos = torch.arange(c0 * far_page, c1 * far_page, device=dev)                  # [C' P]
            if block_table is None:
                x = keys[:, c0 * far_page:c1 * far_page]
                if x.shape[1] < (c1 - c0) * far_page:                                     # the last page, cut
                    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, (c1 - c0) * far_page - x.shape[1]))
            else:
                x = keys[block_table[:, c0:c1].long().clamp(0, keys.shape[0] - 1)].flatten(1, 2)
            x = x.transpose(1, 2)                                                          # [B, Hkv, C' P, d]
        else:
            pos = (t[..., c0:c1, None] * far_page + slot).flatten(2)                      # [B, Hkv, C' P]
            if block_table is None:
                where = (torch.arange(batch, device=dev)[:, None, None], pos.clamp(max=keys.shape[1] - 1), h[..., 0])
            else:
                phys = block_table.long().gather(1, t[..., c0:c1].flatten(1)).view_as(t[..., c0:c1])
                where = (phys.clamp(0, keys.shape[0] - 1)[..., None], slot, h)           # [B, Hkv, C', P] when summed
            if rows is not None:                        # whole rows copied: far faster than indexing 3 ways
                flat = (where[0] * s0 + where[1] * s1 + where[2] * s2).flatten()
                x = rows.index_select(0, flat).view(batch, heads_kv, -1, head_dim)
            else:
                x = keys[where].flatten(2, -2)                                           # [B, Hkv, C' P, d]
        x = _keys_for_bounds(x[..., None, :], pos, cache.keys_rotated, cache.rope, cache.k_scale)    # one "head" axis
        x = x[..., 0, :]
        logits = torch.matmul(q, x.transpose(-1, -2))                                     # [B, Hkv, M, C' P]
        logits = logits.unflatten(-1, (c1 - c0, far_page)).amax(-1)                      # [B, Hkv, M, C']
        top[..., c0:c1] = torch.where(torch.isnan(logits), float("inf"), logits)
    top = torch.where(candidate[:, :, None, :], top * scale, float("-inf"))
    unbounded = (top == float("inf")).any(2) & candidate          # a NaN or infinite key: read, as a NaN bound is
    share = torch.softmax(top, dim=-1).nan_to_num(0.0).mean(2)                           # no candidate: 0
    return torch.where(candidate, torch.where(unbounded, float("inf"), share), float("-inf"))


def _read_best(among, score, win_lo, far_hi, far_page, num_pages, num_slots):
    """Pages ``among [B, Hkv, C]`` (ascending, possibly repeated or out of range) with their bounds
    ``score [B, Hkv, C]`` -> the ``num_slots`` read: the straddlers, then the candidates by bound (ties
    towards the lower page), as ``select_pages`` returns them."""
    in_range = among < num_pages
    t = among.clamp(max=num_pages - 1)
    candidate = in_range & ((t + 1) * far_page <= win_lo)
    straddler = in_range & (t * far_page < far_hi) & ~candidate
    # a page listed twice (a straddler inside a listed group) is read once: keep its straddler entry only
    straddler &= torch.cat([torch.ones_like(straddler[..., :1]), among[..., 1:] != among[..., :-1]], dim=-1)
    candidate &= torch.cat([among[..., :-1] != among[..., 1:], torch.ones_like(candidate[..., :1])], dim=-1)
    rank = torch.where(straddler, float("inf"), torch.where(candidate, score, float("-inf")))
    best = torch.sort(-rank, dim=-1, stable=True).indices[..., :num_slots]
    keep = (candidate | straddler).gather(-1, best)
    pages = torch.sort(torch.where(keep, among.gather(-1, best), num_pages), dim=-1).values
    pages = torch.where(pages == num_pages, -1, pages).to(torch.int32)
    if num_slots > pages.shape[-1]:
        pages = torch.nn.functional.pad(pages, (0, num_slots - pages.shape[-1]), value=-1)
    return pages.contiguous()
