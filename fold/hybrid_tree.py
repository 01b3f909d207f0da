"""``fold.tree_attention``: LongSpec's hybrid tree attention on fold's kernels."""

from __future__ import annotations

import torch

from fold.checks import check_bool
from fold.fold_attention import check_tensor, resolve_backend, validate_query_and_cache, validate_scale, validate_seqlens


def tree_attention(q, k_cache, v_cache, k_tree, v_tree, tree_mask, *, cache_seqlens=None, block_table=None,
                   softmax_scale=None, return_lse=False, backend="auto", check_ranges=None):
    """Attention of speculative tree nodes over the committed cache and their tree ancestors.

    Node ``i`` of sequence ``b`` sees every valid cache entry ``[0, cache_seqlens[b])`` and tree node
    ``j`` iff ``tree_mask[b, i, j]`` (its ancestors and itself); one softmax over both. The two
    segments are read separately (the cache by fold's split-K kernels as a plain read, the tree by a
    small masked kernel) and merged by their log-sum-exp masses.

    Args:
        q: [batch, n_tree, heads_q, head_dim], already rotated at the nodes' positions.
        k_cache, v_cache: [batch, max_len, heads_kv, head_dim], keys rotated at their positions; with
            ``block_table``, pages ``[num_blocks, page_size, heads_kv, head_dim]`` as in
            :func:`fold.attention`.
        k_tree, v_tree: [batch, n_tree, heads_kv, head_dim], the nodes' keys (rotated) and values.
        tree_mask: [batch, n_tree, n_tree] bool. A chain is the lower triangle. A row that sees no
            node and no cache entry is empty: ``out`` 0 and ``lse = -inf``.
        cache_seqlens: [batch] ints in ``[0, max_len]``. Default: ``max_len`` for every sequence;
            required with ``block_table``.
        block_table: [batch, max_blocks] int32, a paged cache (see :func:`fold.attention`).
        softmax_scale: Default ``head_dim ** -0.5``.
        return_lse: also return ``lse`` [batch, n_tree, heads_q] float32, natural log.
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` as in :func:`fold.attention`.
        check_ranges: as in :func:`fold.attention`.

    Returns:
        ``out`` [batch, n_tree, heads_q, head_dim] in q's dtype, or ``(out, lse)``. Forward only
        (see :func:`fold.attention`); the read is the custom op ``torch.ops.fold.tree_attention``.

    Example::

        >>> mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()       # a chain of 4 nodes
        >>> out = fold.tree_attention(q, k_cache, v_cache, k_tree, v_tree, mask)
    """
    check_tensor("k_tree", k_tree, "[batch, n_tree, heads_kv, head_dim]")
    check_tensor("v_tree", v_tree, "[batch, n_tree, heads_kv, head_dim]")
    batch, n_tree, heads_q, head_dim, max_len, heads_kv = validate_query_and_cache(
        q, k_cache, v_cache, q_doc="[batch, n_tree, heads_q, head_dim]", k_name="k_cache", v_name="v_cache",
        extra=(("k_tree", k_tree), ("v_tree", v_tree)), block_table=block_table)
    want_tree = (batch, n_tree, heads_kv, head_dim)
    for name, x in (("k_tree", k_tree), ("v_tree", v_tree)):
        if tuple(x.shape) != want_tree:
            raise ValueError(f"{name} must have shape [batch, n_tree, heads_kv, head_dim] = {want_tree}, "
                             f"got {tuple(x.shape)}")
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool:
        raise TypeError(f"tree_mask must be a bool tensor of shape [batch, n_tree, n_tree], got "
                        f"{getattr(tree_mask, 'dtype', type(tree_mask).__name__)}")
    if tuple(tree_mask.shape) != (batch, n_tree, n_tree) or tree_mask.device != q.device:
        raise ValueError(f"tree_mask must have shape [batch, n_tree, n_tree] = {(batch, n_tree, n_tree)} on "
                         f"{q.device}, got {tuple(tree_mask.shape)} on {tree_mask.device}")
    check_bool("return_lse", return_lse)
    softmax_scale = validate_scale(softmax_scale, head_dim)
    backend = resolve_backend(backend, q)
    cache_seqlens = validate_seqlens(cache_seqlens, block_table, k_cache, batch, max_len, q.device, check_ranges,
                                     minimum=0, lower="0")
    from fold.ops import tree_attention_op

    out, lse = tree_attention_op(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens, block_table,
                                 softmax_scale, backend)
    return (out, lse) if return_lse else out
