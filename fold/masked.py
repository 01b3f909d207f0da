"""``fold.masked.masked_attention``: explicit GQA attention under a boolean mask, as a state ``(o, lse)``.

The small dense reads around fold's kernels (a sliding layer's native window, a tree's edge
entries, a policy's window alone) are all this one computation; it is written here once.
"""

from __future__ import annotations

import torch


def soft_cap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Logit soft-capping (Gemma's): ``softcap * tanh(s / softcap)``; ``softcap = 0`` leaves ``s`` as it is."""
    return torch.tanh(s / softcap) * softcap if softcap else s


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, *,
                     return_lse: bool = True, softcap: float = 0.0, alpha: float = 1.0):
    """``softmax(alpha * cap(q k^T * scale))`` over the entries ``visible`` lets each row see, times ``v``.

    Args:
        q: [Hq, T, d] queries (already rotated), in the dtype to compute in.
        k, v: [Hkv, L, d], ``Hq`` a multiple of ``Hkv`` (grouped-query heads share a key head).
        visible: [T, L] or [Hq, T, L] bool.
        scale: multiplies the logits.
        softcap: ``> 0`` caps each scaled logit to ``softcap * tanh(x / softcap)`` (:func:`soft_cap`); 0: no cap.
        alpha: multiplies the (capped) logits: FOLD's far branch, whose LSE is then ``LSE(alpha * logits)``.
        return_lse: return the state ``(o, lse)``; with False, ``o`` alone (one softmax, no LSE).

    Returns:
        ``o [Hq, T, d]`` and ``lse [Hq, T]`` (natural log, ``-inf`` for a row that sees nothing; that
        row's ``o`` is 0), both in ``q``'s dtype.

    Example::

        >>> o, lse = masked_attention(q, k, v, torch.ones(q.shape[1], k.shape[1], dtype=torch.bool), d ** -0.5)
    """
    group = q.shape[0] // k.shape[0]
    s = torch.einsum("htd,hld->htl", q, k.repeat_interleave(group, 0))                          # [Hq, T, L]
    s = soft_cap(s * scale, softcap) * alpha if softcap else s * (scale * alpha)
    s = s.masked_fill(~visible, float("-inf"))
    v = v.repeat_interleave(group, 0)
    if not return_lse:
        return torch.softmax(s, dim=-1) @ v
    lse = torch.logsumexp(s, dim=-1)                                                             # [Hq, T]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ v, lse
