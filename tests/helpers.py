"""Shared test helpers: inputs, and tolerances scaled to PyTorch's own error in each dtype."""

from dataclasses import dataclass, replace

import torch
from hypothesis import settings

import fold
from reference import apply_rope, fold_attention_ref
from reference.tolerance import check_close as assert_close  # noqa: F401 (re-exported for the tests)


# The Triton kernels run in the interpreter here, ~1-2 s an example: the three kernel-vs-reference
# sweeps draw a third of the profile's examples (20 in CI, 100 with HYPOTHESIS_PROFILE=thorough),
# which keeps the suite within its 10 minutes; their @example cases always run.
INTERPRETED = settings(max_examples=max(10, settings.default.max_examples // 3))


@dataclass(frozen=True)
class Case:
    batch: int = 1
    n_q: int = 4
    heads_kv: int = 1
    group: int = 1
    head_dim: int = 32
    rotary_dim: int = 32
    interleaved: bool = False
    attention_factor: float = 1.0
    max_len: int = 64
    seqlens: tuple | None = None
    window: int = 16
    alpha: float = 2.0
    keys_rotated: bool = False
    queries_rotated: bool = False
    far_position: str = "shared"
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def with_(self, **kw):
        return replace(self, **kw)


def rope_of(case: Case) -> fold.Rope:
    inv_freq = fold.Rope.from_theta(10000.0, case.head_dim, rotary_dim=case.rotary_dim).inv_freq
    return fold.Rope(inv_freq, interleaved=case.interleaved, attention_factor=case.attention_factor)


def make_inputs(case: Case, pad=float("nan")):
    """q, k, v in ``case.dtype``; padding beyond each sequence's length is ``pad``; with
    ``keys_rotated`` the cache holds ``R_j k_j``, with ``queries_rotated`` q holds ``R_{n+r} q``."""
    g = torch.Generator().manual_seed(case.seed)
    heads_q = case.heads_kv * case.group
    q = torch.randn(case.batch, case.n_q, heads_q, case.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(case.batch, case.max_len, case.heads_kv, case.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(case.batch, case.max_len, case.heads_kv, case.head_dim, generator=g, dtype=torch.float64)
    if case.keys_rotated:
        rope = rope_of(case)
        k = apply_rope(k, torch.arange(case.max_len)[None, :, None], rope.inv_freq, rotary_dim=rope.rotary_dim,
                       interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    if case.queries_rotated:
        rope = rope_of(case)
        lengths = case.seqlens or (case.max_len,) * case.batch
        p = torch.tensor(lengths)[:, None] - case.n_q + torch.arange(case.n_q)[None, :]      # [batch, n_q]
        q = apply_rope(q, p[:, :, None], rope.inv_freq, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved,
                       attention_factor=rope.attention_factor)
    q, k, v = (x.to(case.dtype) for x in (q, k, v))
    seqlens = None
    if case.seqlens is not None:
        seqlens = torch.tensor(case.seqlens, dtype=torch.int32)
        for b, length in enumerate(case.seqlens):
            k[b, length:] = pad
            v[b, length:] = pad
    return q, k, v, seqlens


def kwargs_of(case: Case, seqlens):
    return dict(window=case.window, rope=rope_of(case), alpha=case.alpha, cache_seqlens=seqlens,
                keys_rotated=case.keys_rotated, queries_rotated=case.queries_rotated, far_position=case.far_position)


def reference_pair(case: Case, q, k, v, seqlens):
    """(truth in float64, the same math in case.dtype) for out and lse."""
    kw = kwargs_of(case, seqlens)
    return fold_attention_ref(q, k, v, **kw, upcast=True), fold_attention_ref(q, k, v, **kw, upcast=False)


def check_against_reference(case: Case, backend: str):
    q, k, v, seqlens = make_inputs(case)
    out, lse = fold.attention(q, k, v, **kwargs_of(case, seqlens), return_lse=True, backend=backend)
    assert out.dtype == case.dtype and out.shape == q.shape
    assert lse.shape == q.shape[:3]
    (out64, lse64), (out_lp, lse_lp) = reference_pair(case, q, k, v, seqlens)
    assert_close("out", out, out64, out_lp, case.dtype)
    assert_close("lse", lse, lse64, lse_lp, case.dtype)
