"""``fold.tree_attention``: LongSpec's hybrid tree attention on fold's kernels."""

from __future__ import annotations

import contextlib

import torch

from fold.attention import _check_tensor, _validate_seqlens, resolve_backend, validate_query_and_cache, \
    validate_scale


def tree_attention(q, k_cache, v_cache, k_tree, v_tree, tree_mask, *, cache_seqlens=None, softmax_scale=None,
                   return_lse=False, backend="auto"):
    """Attention of speculative tree nodes over the committed cache and their tree ancestors.

    Node ``i`` of sequence ``b`` sees every valid cache entry ``[0, cache_seqlens[b])`` and tree node
    ``j`` iff ``tree_mask[b, i, j]`` (its ancestors and itself); one softmax over both. The two
    segments are read separately (the cache by fold's split-K kernels as a plain read, the tree by a
    small masked kernel) and merged by their log-sum-exp masses.

    Args:
        q: [batch, n_tree, heads_q, head_dim], already rotated at the nodes' positions.
        k_cache, v_cache: [batch, max_len, heads_kv, head_dim], keys rotated at their positions.
        k_tree, v_tree: [batch, n_tree, heads_kv, head_dim], the nodes' keys (rotated) and values.
        tree_mask: [batch, n_tree, n_tree] bool. A chain is the lower triangle.
        cache_seqlens: [batch] ints in ``[0, max_len]``. Default: ``max_len`` for every sequence.
        softmax_scale: Default ``head_dim ** -0.5``.
        return_lse: also return ``lse`` [batch, n_tree, heads_q] float32, natural log.
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` as in :func:`fold.attention`.

    Returns:
        ``out`` [batch, n_tree, heads_q, head_dim] in q's dtype, or ``(out, lse)``.

    Example::

        >>> mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()       # a chain of 4 nodes
        >>> out = fold.tree_attention(q, k_cache, v_cache, k_tree, v_tree, mask)
    """
    _check_tensor("k_tree", k_tree, "[batch, n_tree, heads_kv, head_dim]")
    _check_tensor("v_tree", v_tree, "[batch, n_tree, heads_kv, head_dim]")
    batch, n_tree, heads_q, head_dim, _, heads_kv = validate_query_and_cache(
        q, k_cache, v_cache, q_doc="[batch, n_tree, heads_q, head_dim]", k_name="k_cache", v_name="v_cache",
        extra=(("k_tree", k_tree), ("v_tree", v_tree)))
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
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    softmax_scale = validate_scale(softmax_scale, head_dim)
    backend = resolve_backend(backend, q)
    cache_seqlens = _validate_seqlens(cache_seqlens, batch, k_cache.shape[1], q.device, minimum=0, lower="0")
    if backend == "torch":
        from fold._torch_backend import tree_attention_torch

        out, lse = tree_attention_torch(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens,
                                        softmax_scale=softmax_scale, return_lse=return_lse)
    else:
        from fold.config_lookup import config_for
        from fold.kernels.tree_attention import tree_attention_fwd

        q, k_cache, v_cache, k_tree, v_tree = (x if x.stride(-1) == 1 else x.contiguous()
                                               for x in (q, k_cache, v_cache, k_tree, v_tree))
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            out, lse = tree_attention_fwd(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens,
                                          softmax_scale=softmax_scale, return_lse=return_lse,
                                          config=config_for(q, k_cache, True))
    return (out, lse) if return_lse else out
