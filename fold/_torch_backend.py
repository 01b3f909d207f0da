"""The PyTorch path of ``fold.attention``: any device, memory-bounded, fast on the CPU.

Per sequence the KV axis splits into three segments (``win_lo = n - D + 1``, ``far_hi = n - W``):

    [0, win_lo)        far for every row     -> one fused SDPA read that returns its LSE
    [win_lo, far_hi)   n_q - 1 mixed entries -> explicit logits, a per-row mask, both branches
    [far_hi, L)        window for every row  -> one fused SDPA read of the W + n_q rotated keys

GQA heads are packed into the query axis (``[heads_kv, n_q * group, d]``), so each KV head is read
once. Keys that need a rotation are rotated chunk by chunk, so memory stays ``O(chunk)`` even at
256K. The states merge by LSE: the far ones in alpha-space, then ``lse_far / alpha`` against the
window (``fold.merge_states``' rule).
"""

from __future__ import annotations

import torch

from fold.merge import _merge_pair

ROTATE_CHUNK = 8192   # entries rotated at a time where a segment's keys need rotation
MATH_CHUNK = 4096     # entries per step where no fused kernel returns the LSE


def _rotate(x, pos, inv_freq, rotary_dim, interleaved, factor=1.0):
    # x: [..., N, d]; pos: [N] positions (may be negative); rotary dims times factor, rest unchanged
    angle = pos.to(inv_freq.dtype)[:, None] * inv_freq                      # [N, rotary_dim/2]
    cos, sin = torch.cos(angle) * factor, torch.sin(angle) * factor
    out = torch.empty_like(x)
    pairs = (slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)) if interleaved else \
        (slice(0, rotary_dim // 2), slice(rotary_dim // 2, rotary_dim))
    a, b = x[..., pairs[0]], x[..., pairs[1]]
    out_a, out_b = out[..., pairs[0]], out[..., pairs[1]]
    torch.mul(a, cos, out=out_a)
    out_a.addcmul_(b, sin, value=-1.0)                                      # a cos - b sin
    torch.mul(b, cos, out=out_b)
    out_b.addcmul_(a, sin)                                                  # b cos + a sin
    out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def _empty_state(q):
    return torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)


def _fused_read(q, k, v, scale):
    # q: [H, M, d]; k, v: [H, N, d] (any strides), all one dtype -> (o, lse) in q's dtype, float lse
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], scale=scale)
        return o[0], lse[0]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = _empty_state(q.to(work))
    for c0 in range(0, k.shape[1], MATH_CHUNK):
        kc, vc = k[:, c0:c0 + MATH_CHUNK].to(work), v[:, c0:c0 + MATH_CHUNK].to(work)
        s = torch.einsum("hmd,hnd->hmn", q.to(work), kc) * scale
        lse = torch.logsumexp(s, dim=-1)
        state = _merge_pair(*state, torch.softmax(s, dim=-1) @ vc, lse)
    return state


def _segment_read(q, k, v, scale, key_pos, rope):
    """Attention of ``q [H, M, d]`` (work dtype) over ``k, v [N, H, d]``; ``key_pos`` rotates keys first.

    The CPU's fused kernel is wrong for a last dim with stride != 1 (e.g. ``x[..., ::2]``), so such
    keys and values are copied chunk by chunk, as rotated keys are.
    """
    work = q.dtype
    if k.shape[0] == 0:
        return _empty_state(q)
    unit_stride = k.stride(-1) == 1 and v.stride(-1) == 1
    if key_pos is None and unit_stride:
        o, lse = _fused_read(q.to(k.dtype), k.transpose(0, 1), v.transpose(0, 1), scale)
        return o.to(work), lse.to(work)
    state = _empty_state(q)
    q_in = q.to(k.dtype)
    for c0 in range(0, k.shape[0], ROTATE_CHUNK):
        kc = k[c0:c0 + ROTATE_CHUNK].transpose(0, 1)                            # [H, C, d]
        vc = v[c0:c0 + ROTATE_CHUNK].transpose(0, 1)
        if key_pos is not None:
            inv_freq, rotary_dim, interleaved = rope
            kc = _rotate(kc.to(work), key_pos[c0:c0 + ROTATE_CHUNK], inv_freq, rotary_dim, interleaved).to(k.dtype)
        else:
            kc = kc.contiguous()
        o, lse = _fused_read(q_in, kc, vc if vc.stride(-1) == 1 else vc.contiguous(), scale)
        state = _merge_pair(*state, o.to(work), lse.to(work))
    return state


def _masked_read(q, k, v, scale, visible):
    """Explicit attention for a few entries: q [H, M, d], k, v [H, N, d], visible [M, N] bool."""
    s = torch.einsum("hmd,hnd->hmn", q, k) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                         # [H, M]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ v, lse


def fold_attention_torch(q, k, v, inv_freq, cache_seqlens, *, window, alpha, softmax_scale, rotary_dim,
                         interleaved, attention_factor, keys_rotated, return_lse, far_distance_per_row=True):
    """Same contract as the Triton launcher: validated inputs in, ``(out, lse or None)`` out.

    ``far_distance_per_row=False`` reads every far entry at distance ``D`` from every row instead of
    ``D + r`` (ReRoPE's rule, used by that baseline of the adapter)."""
    batch, n_q, heads_q, head_dim = q.shape
    max_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    seqlens = [max_len] * batch if cache_seqlens is None else cache_seqlens.tolist()
    rope = (inv_freq.to(work), rotary_dim, interleaved)
    q_rot_scale = attention_factor if keys_rotated else attention_factor * attention_factor
    row_r = torch.arange(n_q, device=q.device).repeat_interleave(group)     # [M] row m = r * group + h
    out = torch.empty_like(q)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse_out = torch.empty(batch, n_q, heads_q, device=q.device, dtype=lse_dtype) if return_lse else None
    for b, length in enumerate(seqlens):
        n = length - n_q
        win_lo, far_hi = n - window - n_q + 1, n - window
        a, c = max(0, win_lo), max(0, far_hi)
        qm = q[b].to(work).view(n_q, heads_kv, group, head_dim).transpose(0, 1).reshape(heads_kv, n_q * group, head_dim)
        q_far = _rotate(qm, window + n_q + (row_r if far_distance_per_row else 0 * row_r), *rope, factor=q_rot_scale)
        q_win = _rotate(qm, row_r + (n if keys_rotated else 0), *rope, factor=q_rot_scale)  # unrotated: relative to n
        kb, vb = k[b, :length], v[b, :length]
        j = torch.arange(length, device=q.device)

        far = _segment_read(q_far, kb[:a], vb[:a], alpha * softmax_scale, -j[:a] if keys_rotated else None, rope)
        win = _segment_read(q_win, kb[c:], vb[c:], softmax_scale, None if keys_rotated else j[c:] - n, rope)
        if c > a:
            km = kb[a:c].transpose(0, 1).to(work)                              # [Hkv, n_q - 1, d]
            vm = vb[a:c].transpose(0, 1).to(work)
            jm = j[a:c]
            in_window = jm[None, :] >= (win_lo + row_r)[:, None]               # [M, c - a]
            k_far = _rotate(km, -jm, *rope) if keys_rotated else km
            k_win = km if keys_rotated else _rotate(km, jm - n, *rope)
            far = _merge_pair(*far, *_masked_read(q_far, k_far, vm, alpha * softmax_scale, ~in_window))
            win = _merge_pair(*win, *_masked_read(q_win, k_win, vm, softmax_scale, in_window))
        o, lse = _merge_pair(*win, far[0], far[1] / alpha)                    # [Hkv, M, d], [Hkv, M]
        out[b] = o.view(heads_kv, n_q, group, head_dim).transpose(0, 1).reshape(n_q, heads_q, head_dim)
        if return_lse:
            lse_out[b] = lse.view(heads_kv, n_q, group).transpose(0, 1).reshape(n_q, heads_q)
    return out, lse_out


def tree_attention_torch(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens, *, softmax_scale,
                         return_lse):
    """Hybrid tree attention: the cache through one fused read with LSE, the tree explicitly, one merge."""
    batch, n_tree, heads_q, head_dim = q.shape
    max_len, heads_kv = k_cache.shape[1], k_cache.shape[2]
    group = heads_q // heads_kv
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    seqlens = [max_len] * batch if cache_seqlens is None else cache_seqlens.tolist()
    node = torch.arange(n_tree, device=q.device).repeat_interleave(group)             # row m = i * group + h
    out = torch.empty_like(q)
    lse_out = torch.empty(batch, n_tree, heads_q, device=q.device, dtype=work if work == torch.float64
                          else torch.float32) if return_lse else None
    for b, length in enumerate(seqlens):
        qm = q[b].view(n_tree, heads_kv, group, head_dim).transpose(0, 1).reshape(heads_kv, n_tree * group, head_dim)
        cached = _segment_read(qm.to(work), k_cache[b, :length], v_cache[b, :length], softmax_scale, None, None)
        tree = _masked_read(qm.to(work), k_tree[b].transpose(0, 1).to(work), v_tree[b].transpose(0, 1).to(work),
                            softmax_scale, tree_mask[b][node])
        o, lse = _merge_pair(*cached, *tree)
        out[b] = o.view(heads_kv, n_tree, group, head_dim).transpose(0, 1).reshape(n_tree, heads_q, head_dim)
        if return_lse:
            lse_out[b] = lse.view(heads_kv, n_tree, group).transpose(0, 1).reshape(n_tree, heads_q)
    return out, lse_out
