"""``fold.merge_states``: combine attention states read over disjoint segments."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fold.rope import work_dtype


def merge_pair(o_a, lse_a, o_b, lse_b):
    """The LSE merge of two states, in their dtype (no checks): ``o [..., d]``, ``lse [...]`` natural log."""
    # o: [..., d] float; lse: [...] float, -inf for an empty state. Weights first, then outputs.
    # An empty pair stays (0, -inf) instead of (-inf) - (-inf) = NaN; an empty state's o is never
    # read. NaN anywhere else (a NaN query or key of a non-empty state) propagates to the result.
    empty_a, empty_b = lse_a == float("-inf"), lse_b == float("-inf")
    m = torch.maximum(lse_a, lse_b)                                    # NaN if either is NaN
    m_safe = torch.where(empty_a & empty_b, torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    denom = torch.where(empty_a & empty_b, torch.ones_like(m), w_a + w_b)
    o_a = torch.where(empty_a[..., None], 0.0, o_a)
    o_b = torch.where(empty_b[..., None], 0.0, o_b)
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / denom[..., None]
    lse = torch.where(empty_a & empty_b, torch.full_like(m, float("-inf")), m_safe + torch.log(denom))
    return o, lse


def merge_into(state, o, lse):
    """Online merge of a non-empty state ``(o, lse)`` into ``state`` (``None`` to start), in place where
    it can: the running read of split or chunked segments. Neither side may be empty (``lse = -inf``);
    use :func:`merge_pair` where one can be. NaN propagates."""
    if state is None:
        return o, lse
    o_acc, lse_acc = state
    m = torch.maximum(lse_acc, lse)
    w_acc, w = torch.exp(lse_acc - m), torch.exp(lse - m)
    total = w_acc + w
    o_acc.mul_((w_acc / total)[..., None]).addcmul_(o, (w / total)[..., None])
    return o_acc, m + torch.log(total)


def merge_states(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    """Merge attention states ``(o_i, lse_i)`` of disjoint key segments into one state.

    With ``Z_i = exp(lse_i)``: ``o = sum_i Z_i o_i / sum_i Z_i`` and ``lse = log sum_i Z_i``, the
    exact attention over the union of the segments. An empty segment is ``(anything, -inf)``; if
    all are empty the result is ``(0, -inf)``. The merge is commutative and associative.

    Args:
        outputs: tensors ``[batch, n_q, heads, head_dim]`` (any leading shape, all equal).
        lses: tensors ``[batch, n_q, heads]``, natural log (as ``fold.attention(return_lse=True)``).

    Returns:
        ``(o, lse)``: ``o`` in ``outputs[0].dtype``, ``lse`` float32 (float64 for float64 inputs).

    Example::

        >>> o1, lse1 = fold.attention(q, k1, v1, window=w, rope=rope, return_lse=True)
        >>> o, lse = fold.merge_states([o1, o2], [lse1, lse2])
    """
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(f"outputs and lses must be lists (or tuples) of tensors, got {type(outputs).__name__} and "
                        f"{type(lses).__name__}")
    if len(outputs) != len(lses) or len(outputs) == 0:
        raise ValueError(f"outputs and lses must be non-empty and of equal length, got {len(outputs)} and {len(lses)}")
    ref_o = outputs[0]
    for i, (o, lse) in enumerate(zip(outputs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise TypeError(f"outputs[{i}] and lses[{i}] must be torch.Tensors")
        if o.shape != ref_o.shape or o.ndim < 1:
            raise ValueError(f"outputs[{i}] must have shape {tuple(ref_o.shape)}, got {tuple(o.shape)}")
        if lse.shape != o.shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {tuple(o.shape[:-1])} (outputs[{i}] without its "
                             f"last dim), got {tuple(lse.shape)}")
        if o.device != ref_o.device or lse.device != ref_o.device:
            raise ValueError(f"outputs[{i}] and lses[{i}] must be on {ref_o.device}")
        if not o.is_floating_point() or not lse.is_floating_point():
            raise TypeError(f"outputs[{i}] and lses[{i}] must be floating point")
    work = work_dtype(ref_o.dtype)
    o, lse = outputs[0].to(work), lses[0].to(work)
    # +inf is FA2's marker for an empty row; read it as empty
    lse = torch.where(lse == float("inf"), float("-inf"), lse)
    for o_i, lse_i in zip(outputs[1:], lses[1:]):
        lse_i = torch.where(lse_i == float("inf"), float("-inf"), lse_i.to(work))
        o, lse = merge_pair(o, lse, o_i.to(work), lse_i)
    if len(outputs) == 1:
        o = torch.where((lse == float("-inf"))[..., None], 0.0, o)
    return o.to(ref_o.dtype), lse
