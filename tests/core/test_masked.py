"""fold.masked.masked_attention: the dense masked GQA read the policies and tree verification share."""

import torch

from fold.masked import masked_attention


def _dense(q, k, v, visible, scale):
    # one head at a time, float64, no grouping tricks
    group = q.shape[0] // k.shape[0]
    o, lse = torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), dtype=q.dtype)
    for h in range(q.shape[0]):
        for t in range(q.shape[1]):
            cols = visible[t].nonzero().flatten()
            if len(cols):
                s = (k[h // group, cols] @ q[h, t]) * scale
                lse[h, t] = torch.logsumexp(s, 0)
                o[h, t] = torch.softmax(s, 0) @ v[h // group, cols]
    return o, lse


def test_state_matches_a_per_head_softmax_and_an_empty_row_is_zero():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((6, 5, 8), (2, 7, 8), (2, 7, 8)))
    visible = torch.rand(5, 7, generator=g) < 0.6
    visible[2] = False                                                   # a row that sees nothing
    o, lse = masked_attention(q, k, v, visible, 0.3)
    want_o, want_lse = _dense(q, k, v, visible, 0.3)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(o, want_o)
    assert bool((o[:, 2] == 0).all()) and bool((lse[:, 2] == float("-inf")).all())
    rows = visible.any(dim=1)
    torch.testing.assert_close(masked_attention(q, k, v, visible, 0.3, return_lse=False)[:, rows], want_o[:, rows])
