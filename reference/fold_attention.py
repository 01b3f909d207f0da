"""FOLD attention for a draft block, dense and explicit (paper Eqs. 1-4).

Sequence ``b`` holds ``L = cache_seqlens[b]`` entries: ``n = L - n_q`` committed context entries,
then the ``n_q`` block entries. Query row ``r`` sits at position ``p = n + r`` and ``D = W + n_q``.
Entry ``j`` is in the window of row ``r`` iff ``p - j < D``, else in the far memory.

    window logit  s_rj = (R_p q_r) . (R_j k_j) * scale
    far logit     f_rj = (R_{D+r} q_r) . (R_0 k_j) * scale      (every far entry at one position)
    (with ``softcap = c`` both become ``c * tanh(x / c)``, before alpha)
    Z_N = sum_window exp(s),   Z_F = (sum_far exp(alpha * f)) ** (1 / alpha)
    out = (Z_N o_N + Z_F o_F) / (Z_N + Z_F),   lse = log(Z_N + Z_F)

A sliding-window layer (``sliding_window = Ws``, the paper's per-layer rule) keeps its native window
as the local branch: entry ``j`` is local for row ``r`` iff ``p - j < Ws``, and every older entry is
far memory, still read at the full layers' far position (distance ``D + r``). ``causal`` hides the
block's later entries (``j > p``) from row ``r``. ``far_position="none"`` reads the local branch
alone (FOLD's window, or a sliding layer's native read).

A budgeted read (``far_budget=N``, pages of ``far_page = P`` entries) reads, per sequence and KV head,
only ``K = N // P`` pages of the far memory: the straddling pages (an entry far for some row but not
for every row, or a page that also holds entries that are not far) always, then the pages that are far
for every row ranked by ``bound(t) = scale * alpha * max over rows and the group's heads of
sum_i max(q~_i max_i, q~_i min_i)`` (``q~`` the far query, ``max``/``min`` the elementwise bounds of
the page's ``R_0 k``; an empty box ranks -inf, a NaN bound +inf), ties towards the lower page, among
the candidates of the ``max(2 K, 16)`` groups of 16 consecutive pages whose box (the elementwise max /
min of their pages' boxes) has the highest bound of the same form (ties towards the lower group). Each row still counts only its own far
entries of those pages (:func:`select_far_pages_ref`).

``R_0 k`` is ``k`` with its rotary dimensions times ``attention_factor`` (1 unless YaRN), which is
what "read at the shared virtual position" means: ``(R_{D+r} q) . (R_0 k) = (R_p q) . (R_{n-D} k)``.
With ``keys_rotated`` the cache holds ``R_j k_j`` and is un-rotated here first; with
``queries_rotated`` the block's queries arrive as ``R_p q`` (at their true positions ``p = n + r``,
as engines rotate them) and are un-rotated here first.

Nothing here is fast: logits are materialised as ``[heads_q, n_q, L]`` per sequence.
"""

import torch

from reference.merge import merge_states_ref
from reference.rope import apply_rope


def fold_attention_ref(q, k, v, *, window, rope, alpha=2.0, cache_seqlens=None, keys_rotated=False,
                       queries_rotated=False, softmax_scale=None, far_position="shared", sliding_window=None,
                       causal=False, k_scale=1.0, v_scale=1.0, upcast=True, far_budget=None, far_page=64,
                       far_bounds=None, far_rank="bound", softcap=None):
    """Reference FOLD attention.

    q:    [batch, n_q, heads_q, head_dim], pre-RoPE queries of the draft block (``R_{n+r} q`` with
          ``queries_rotated``)
    k, v: [batch, max_len, heads_kv, head_dim]; the first ``cache_seqlens[b]`` entries are valid
    rope: any object with ``inv_freq``, ``rotary_dim``, ``interleaved``, ``attention_factor``
    far_position: ``"shared"`` reads row r's far memory at distance ``D + r``; ``"fixed_distance"``
        (ReRoPE's rule) at distance ``D`` from every row; ``"none"`` reads no far memory
    sliding_window: None, or ``Ws``: the local branch is ``p - j < Ws`` instead of ``p - j < D``
    causal: row r does not see the block's entries after its own (``j > p``)
    k_scale, v_scale: the cache holds ``k / k_scale`` and ``v / v_scale`` (an FP8 cache); read as
        ``k.to(dtype) * k_scale``
    upcast: compute in float64 (the truth); ``False`` computes in q's dtype, which is how
        large an error PyTorch itself makes in that dtype.
    far_budget, far_page: None (every far entry), or read only ``far_budget // far_page`` far pages per
        sequence and KV head (``far_position="shared"`` only); the pages are chosen in float64 whatever
        ``upcast`` says, so both computations read the same entries
    far_bounds: None (bounds from ``k``), or ``[batch, >= ceil(max_len / P), heads_kv, 2, head_dim]``: the
        elementwise max / min of each page's unrotated, dequantized keys (see ``fold.far_pages``)
    far_rank: ``"bound"`` ranks the listed pages by their boxes, ``"keys"`` by their keys (each row's and
        head's largest far logit per page, as a softmax share over the listed candidates, averaged)
    softcap: None, or ``c``: every logit (window and far) ``x`` becomes ``c * tanh(x / c)``; the far
        branch's alpha multiplies the capped logit. The page choice of a budget ranks uncapped logits.

    Returns ``(out [batch, n_q, heads_q, head_dim], lse [batch, n_q, heads_q])``, both in float64
    with ``upcast`` and in ``q.dtype`` otherwise; ``lse`` is in natural log.
    """
    batch, n_q, heads_q, head_dim = q.shape
    max_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    seqlens = [max_len] * batch if cache_seqlens is None else [int(x) for x in cache_seqlens]
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    inv_freq = rope.inv_freq.to(q.device)
    d_pos = window + n_q
    outs, lses = [], []
    span = d_pos if sliding_window is None else sliding_window      # the local branch: p - j < span
    dtype = torch.float64 if upcast else q.dtype
    for b, length in enumerate(seqlens):
        n = length - n_q
        qb = q[b].to(dtype)                                                     # [n_q, Hq, d]
        kb = (k[b, :length].to(dtype) * k_scale).repeat_interleave(group, dim=1)   # [L, Hq, d]
        vb = (v[b, :length].to(dtype) * v_scale).repeat_interleave(group, dim=1)
        j = torch.arange(length, device=q.device)
        r = torch.arange(n_q, device=q.device)
        if keys_rotated:
            kb = apply_rope(kb, j[:, None], inv_freq, inverse=True, **rot)
        if queries_rotated:
            qb = apply_rope(qb, (n + r)[:, None], inv_freq, inverse=True, **rot)
        k_window = apply_rope(kb, j[:, None], inv_freq, **rot)
        k_far = apply_rope(kb, torch.zeros_like(j)[:, None], inv_freq, **rot)
        q_window = apply_rope(qb, (n + r)[:, None], inv_freq, **rot)
        q_far = apply_rope(qb, (d_pos + r if far_position == "shared" else d_pos + 0 * r)[:, None], inv_freq, **rot)
        s_window = torch.einsum("rhd,jhd->hrj", q_window, k_window) * scale     # [Hq, n_q, L]
        s_far = torch.einsum("rhd,jhd->hrj", q_far, k_far) * scale
        if softcap is not None:
            s_window = softcap * torch.tanh(s_window / softcap)
            s_far = softcap * torch.tanh(s_far / softcap)
        behind = (n + r)[:, None] - j[None, :]                                  # p - j, [n_q, L]
        in_window = behind < span
        is_far = ~in_window if far_position != "none" else torch.zeros_like(in_window)
        if far_budget is not None:
            read = select_far_pages_ref(q[b], k[b, :length], n=n, span=span, window=window, rope=rope,
                                        scale=scale * alpha, far_budget=far_budget, far_page=far_page,
                                        bounds=None if far_bounds is None else far_bounds[b], k_scale=k_scale,
                                        keys_rotated=keys_rotated, queries_rotated=queries_rotated, rank=far_rank)
            page_read = read.repeat_interleave(group, dim=0)[:, j // far_page]       # [Hq, L]
            is_far = is_far[None] & page_read[:, None, :]                            # [Hq, n_q, L]
        if causal:
            in_window &= behind >= 0
        neg_inf = torch.tensor(float("-inf"), dtype=s_window.dtype, device=q.device)
        s_window = torch.where(in_window, s_window, neg_inf)
        s_far = torch.where(is_far, alpha * s_far, neg_inf)
        lse_window = torch.logsumexp(s_window, dim=-1)                         # [Hq, n_q]
        lse_far_alpha = torch.logsumexp(s_far, dim=-1)
        o_window = torch.einsum("hrj,jhd->rhd", torch.softmax(s_window, dim=-1), vb)
        has_far = lse_far_alpha != float("-inf")                                 # NaN stays NaN
        p_far = torch.where(has_far[..., None], torch.softmax(s_far, dim=-1), 0.0)
        o_far = torch.einsum("hrj,jhd->rhd", p_far, vb)
        out, lse = merge_states_ref(
            [o_window, o_far], [lse_window.transpose(0, 1), (lse_far_alpha / alpha).transpose(0, 1)]
        )
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def select_far_pages_ref(q, k, *, n, span, window, rope, scale, far_budget, far_page, bounds=None, k_scale=1.0,
                         keys_rotated=False, queries_rotated=False, rank="bound"):
    """The far pages a budgeted read of one sequence reads, in float64: ``[heads_kv, num_pages]`` bool.

    q: [n_q, heads_q, head_dim] the block's queries (as ``fold_attention_ref`` takes them)
    k: [L, heads_kv, head_dim] the sequence's valid keys (as stored)
    n, span: row r reads entry j as far memory iff ``j <= n + r - span``
    bounds: None (from ``k``), or ``[>= num_pages, heads_kv, 2, head_dim]`` bounds of the unrotated keys
    rank: ``"bound"`` (the listed candidates by their box bound) or ``"keys"`` (by their keys' far logits)
    """
    n_q, heads_q, head_dim = q.shape
    length, heads_kv = k.shape[0], k.shape[1]
    group = heads_q // heads_kv
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    inv_freq = rope.inv_freq.to(q.device)
    r = torch.arange(n_q, device=q.device)
    q64 = q.to(torch.float64)
    if queries_rotated:
        q64 = apply_rope(q64, (n + r)[:, None], inv_freq, inverse=True, **rot)
    q_far = apply_rope(q64, (window + n_q + r)[:, None], inv_freq, **rot)                  # [n_q, Hq, d]
    num_pages = -(-length // far_page)
    kb = k.to(torch.float64) * k_scale
    if keys_rotated:
        kb = apply_rope(kb, torch.arange(length, device=q.device)[:, None], inv_freq, inverse=True, **rot)
    k_far = apply_rope(kb, torch.zeros(length, 1, device=q.device), inv_freq, **rot)      # R_0 k
    if bounds is None:
        pages = [k_far[t * far_page:(t + 1) * far_page] for t in range(num_pages)]      # each [<= P, Hkv, d]
        hi = torch.stack([p.amax(0) for p in pages])                                    # [T, Hkv, d]
        lo = torch.stack([p.amin(0) for p in pages])
    else:
        factor = torch.ones(head_dim, dtype=torch.float64, device=q.device)
        factor[:rope.rotary_dim] = rope.attention_factor                                 # R_0 k = f k on rotary dims
        hi = bounds[:num_pages, :, 0].to(torch.float64) * factor
        lo = bounds[:num_pages, :, 1].to(torch.float64) * factor
    # bound[h, t]: the largest logit any row or head of group h could have with a key in page t's box
    q_g = q_far.view(n_q, heads_kv, group, head_dim)[:, :, :, None, :]                   # [n_q, Hkv, g, 1, d]
    per_key = torch.maximum(q_g * hi.transpose(0, 1)[None, :, None], q_g * lo.transpose(0, 1)[None, :, None])
    bound = scale * per_key.sum(-1).amax(dim=(0, 2))                                    # [Hkv, T]
    bound = torch.where(torch.isnan(bound), float("inf"), bound)
    bound = torch.where((hi < lo).any(-1).transpose(0, 1), float("-inf"), bound)          # an empty box
    # groups of 16 consecutive pages: the box of their boxes, bounded the same way
    groups = -(-num_pages // 16)
    g_hi = torch.stack([hi[g * 16:(g + 1) * 16].amax(0) for g in range(groups)])        # [groups, Hkv, d]
    g_lo = torch.stack([lo[g * 16:(g + 1) * 16].amin(0) for g in range(groups)])
    g_key = torch.maximum(q_g * g_hi.transpose(0, 1)[None, :, None], q_g * g_lo.transpose(0, 1)[None, :, None])
    g_bound = g_key.sum(-1).amax(dim=(0, 2))                                             # [Hkv, groups]
    g_bound = torch.where(torch.isnan(g_bound), float("inf"), g_bound)
    g_bound = torch.where((g_hi < g_lo).any(-1).transpose(0, 1), float("-inf"), g_bound)
    win_lo = n - span + 1                   # entries < win_lo are far for every row
    far_hi = win_lo + n_q - 1               # entries < far_hi are far for some row
    budget = far_budget // far_page
    read = torch.zeros(heads_kv, num_pages, dtype=torch.bool, device=q.device)
    for h in range(heads_kv):
        candidates = [t for t in range(num_pages) if (t + 1) * far_page <= win_lo]
        straddlers = [t for t in range(num_pages) if t * far_page < far_hi and (t + 1) * far_page > win_lo]
        # the max(2 K, 16) groups with the highest bounds among those holding a candidate; their candidates
        best_groups = sorted({t // 16 for t in candidates}, key=lambda g: (-g_bound[h, g].item(), g))
        listed = set(best_groups[:max(2 * budget, 16)])
        among = [t for t in candidates if t // 16 in listed]
        score = bound[h]
        if rank == "keys" and among:
            # per row and head of the group: each listed page's largest far logit, softmax over the listed pages
            q_h = q_far[:, h * group:(h + 1) * group].reshape(-1, head_dim)                     # [n_q g, d]
            top = torch.stack([(q_h @ k_far[t * far_page:(t + 1) * far_page, h].T).amax(-1) for t in among], -1)
            shares = torch.softmax(scale * top, dim=-1).mean(0)                                   # [len(among)]
            score = torch.full((num_pages,), float("-inf"), dtype=torch.float64, device=q.device)
            score[among] = shares
        ranked = sorted(among, key=lambda t: (-score[t].item(), t))
        for t in straddlers + ranked[:budget - len(straddlers)]:
            read[h, t] = True
    return read


def rope_attention_ref(q, k, v, *, rope, cache_seqlens=None, keys_rotated=False, queries_rotated=False,
                       softmax_scale=None, upcast=True):
    """Plain RoPE attention of the block over all valid entries (no window, no far memory).

    Same shapes and return as :func:`fold_attention_ref`; row ``r`` is at position ``L - n_q + r``
    and sees every valid entry, the block's own included (the block is bidirectional).
    """
    huge = k.shape[1] + q.shape[1]
    return fold_attention_ref(q, k, v, window=huge, rope=rope, alpha=1.0, cache_seqlens=cache_seqlens,
                              keys_rotated=keys_rotated, queries_rotated=queries_rotated,
                              softmax_scale=softmax_scale, upcast=upcast)


def attention_with_kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, rope, rotate_new_keys=False,
                               cache_batch_idx=None, cache_leftpad=None, block_table=None, **read):
    """The append form (``fold.attention_with_kvcache``), written out: copies of the caches with ``k``, ``v``
    [batch, n_new, heads_kv, head_dim] written at ``cache_seqlens[b] + i`` of sequence b's row (``rope``
    applied at ``index - cache_leftpad[b]`` with ``rotate_new_keys``), each sequence's entries
    ``[cache_leftpad[b], cache_seqlens[b] + n_new)`` gathered densely, then :func:`fold_attention_ref` over
    them (``read``: its other arguments). The caller's caches are not changed.

    Returns ``(out, lse, k_cache_after, v_cache_after)``, the last two what the cache must hold afterwards."""
    batch = q.shape[0]
    n_new = 0 if k is None else k.shape[1]
    seqlens = [int(x) for x in (cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * batch)]
    starts = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad]
    rows = list(range(batch)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    k_after, v_after = k_cache.clone(), v_cache.clone()
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)

    def where(b, index):                     # (row, column) of sequence b's cache index
        if block_table is None:
            return rows[b], index
        page = k_cache.shape[1]
        return int(block_table[b, index // page]), index % page

    for b in range(batch):
        for i in range(n_new):
            index = seqlens[b] + i
            key = k[b, i]
            if rotate_new_keys:
                key = apply_rope(key.to(torch.float64), torch.tensor(index - starts[b]), rope.inv_freq,
                                 **rot).to(k_cache.dtype)
            k_after[where(b, index)] = key
            v_after[where(b, index)] = v[b, i]
    lengths = [seqlens[b] + n_new - starts[b] for b in range(batch)]
    width = max(lengths)
    dense_k = k_cache.new_zeros((batch, width) + tuple(k_cache.shape[2:]))
    dense_v = torch.zeros_like(dense_k)
    for b in range(batch):
        for j in range(lengths[b]):
            dense_k[b, j] = k_after[where(b, starts[b] + j)]
            dense_v[b, j] = v_after[where(b, starts[b] + j)]
    out, lse = fold_attention_ref(q, dense_k, dense_v, rope=rope, cache_seqlens=lengths, **read)
    return out, lse, k_after, v_after
