"""Merging attention states by their log-sum-exp mass.

A state ``(o, lse)`` summarises attention over a segment: ``o`` is the softmax-weighted value and
``lse = log Z`` the log of the segment's mass. Segments read separately merge exactly:
``Z = sum_i Z_i`` and ``o = sum_i Z_i o_i / Z``. An empty segment is ``(0, -inf)``.
"""

import torch


def merge_states_ref(outputs, lses):
    """Merge states ``(outputs[i] [..., head_dim], lses[i] [...])`` into one ``(o, lse)``.

    Computed in the inputs' dtype (pass float64 for the truth). If every state is empty the result
    is ``(0, -inf)``; a NaN in any non-empty state gives NaN, as one softmax over the union would.
    """
    lse_all = torch.stack(list(lses))                         # [S, ...]
    lse = torch.logsumexp(lse_all, dim=0)                     # [...]; -inf if all empty
    empty = lse == float("-inf")
    weights = torch.exp(lse_all - torch.where(empty, 0.0, lse))
    weights = torch.where(empty, 0.0, weights)                # [S, ...]
    out = sum(w[..., None] * o.to(w.dtype) for w, o in zip(weights, outputs))
    return out, lse
