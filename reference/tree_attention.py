"""Hybrid tree attention (LongSpec), dense: every node sees the committed cache and its tree ancestors.

Keys are ``[k_cache[:L] ; k_tree]`` and node ``i`` sees cache entry ``j < L`` always and tree node
``j`` iff ``tree_mask[i, j]``; one softmax. Queries and keys are already rotated.
"""

import torch


def tree_attention_ref(q, k_cache, v_cache, k_tree, v_tree, tree_mask, *, cache_seqlens=None, softmax_scale=None,
                       upcast=True):
    """q [B, n_tree, Hq, d]; k/v_cache [B, max_len, Hkv, d]; k/v_tree [B, n_tree, Hkv, d];
    tree_mask [B, n_tree, n_tree] bool. Returns ``(out [B, n_tree, Hq, d], lse [B, n_tree, Hq])``,
    float64 with ``upcast``, else in q's dtype."""
    batch, n_tree, heads_q, head_dim = q.shape
    group = heads_q // k_cache.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    seqlens = [k_cache.shape[1]] * batch if cache_seqlens is None else [int(x) for x in cache_seqlens]
    cast = (lambda x: x.to(torch.float64)) if upcast else (lambda x: x)
    outs, lses = [], []
    for b, length in enumerate(seqlens):
        keys = cast(torch.cat([k_cache[b, :length], k_tree[b]])).repeat_interleave(group, dim=1)   # [L + T, Hq, d]
        values = cast(torch.cat([v_cache[b, :length], v_tree[b]])).repeat_interleave(group, dim=1)
        visible = torch.cat([torch.ones(n_tree, length, dtype=torch.bool, device=q.device), tree_mask[b]], dim=1)
        s = torch.einsum("ihd,jhd->hij", cast(q[b]), keys) * scale
        s = s.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                                         # [Hq, T]
        p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
        outs.append(torch.einsum("hij,jhd->ihd", p, values))
        lses.append(lse.transpose(0, 1))
    return torch.stack(outs), torch.stack(lses)
