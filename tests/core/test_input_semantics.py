"""Inputs that are valid but unusual must never give a silently wrong answer: strided caches, NaN in
valid entries (it must show, as in SDPA), NaN in padding (it must not), the largest alpha, autograd."""

import pytest
import torch

import fold
from reference import fold_attention_ref, tree_attention_ref
from fold.spec_decode.tree import tree_mask
from tests.helpers import Case, assert_close, kwargs_of, make_inputs, reference_pair

BACKENDS = ["torch", "triton"]
CASE = Case(batch=2, n_q=4, heads_kv=2, group=2, head_dim=16, rotary_dim=16, max_len=64, seqlens=(64, 37), window=8)


def _strided(x, how):
    """The same values as ``x [B, L, H, d]`` in another memory layout."""
    if how == "last-dim-stride-2":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "heads-major":                        # an engine's [B, H, L, d] cache seen as [B, L, H, d]
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "padded-rows":
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
        wide[..., :x.shape[-1]] = x
        return wide[..., :x.shape[-1]]
    raise ValueError(how)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["last-dim-stride-2", "heads-major", "padded-rows"])
@pytest.mark.parametrize("keys_rotated", [False, True])
def test_any_cache_layout_gives_the_reference(backend, how, keys_rotated):
    case = CASE.with_(keys_rotated=keys_rotated)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    ks, vs = _strided(k, how), _strided(v, how)
    assert torch.equal(ks, k) and ks.stride() != k.stride()
    out = fold.attention(_strided(q, how), ks, vs, **kwargs_of(case, seqlens), backend=backend)
    (out64, _), (out_lp, _) = reference_pair(case, q, k, v, seqlens)
    assert_close(f"out ({how})", out, out64, out_lp, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["last-dim-stride-2", "heads-major"])
def test_tree_attention_reads_any_cache_layout(backend, how):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 4, 16, generator=g)
    kc, vc = torch.randn(1, 70, 2, 16, generator=g), torch.randn(1, 70, 2, 16, generator=g)
    kt, vt = torch.randn(1, 5, 2, 16, generator=g), torch.randn(1, 5, 2, 16, generator=g)
    mask = tree_mask([-1, 0, 0, 1, 2])[None]
    out = fold.tree_attention(q, _strided(kc, how), _strided(vc, how), _strided(kt, how), _strided(vt, how), mask,
                              backend=backend)
    out64, _ = tree_attention_ref(q, kc, vc, kt, vt, mask)
    out_lp, _ = tree_attention_ref(q, kc, vc, kt, vt, mask, upcast=False)
    assert_close(f"tree out ({how})", out, out64, out_lp, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_query_row_gives_nan_in_that_row_only(backend):
    q, k, v, seqlens = make_inputs(CASE)
    q[1, 2, 3, 5] = float("nan")
    out = fold.attention(q, k, v, **kwargs_of(CASE, seqlens), backend=backend)
    assert torch.isnan(out[1, 2, 3]).all()
    nan_rows = torch.isnan(out).any(-1)
    nan_rows[1, 2, 3] = False
    assert not nan_rows.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["far", "window", "block"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_nan_in_a_valid_entry_shows_in_every_row_that_reads_it(backend, where, tensor):
    """As in SDPA and the reference: a NaN key or value poisons the rows that read that entry (its
    KV head's rows); entries beyond cache_seqlens are NaN already (make_inputs pads with NaN)."""
    q, k, v, seqlens = make_inputs(CASE)
    j = {"far": 3, "window": 30, "block": 35}[where]                 # sequence 1: n = 33, row r windows j >= 22 + r
    (k if tensor == "k" else v)[1, j, 0, 7] = float("nan")
    out = fold.attention(q, k, v, **kwargs_of(CASE, seqlens), backend=backend)
    want, _ = fold_attention_ref(q, k, v, **kwargs_of(CASE, seqlens))
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.isnan(out[1, :, :2]).any() and not torch.isnan(out[0]).any() and not torch.isnan(out[1, :, 2:]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_largest_alpha_is_exact(backend):
    case = CASE.with_(alpha=fold.attention.__globals__["MAX_ALPHA"])
    q, k, v, seqlens = make_inputs(case)
    out, lse = fold.attention(q, k, v, **kwargs_of(case, seqlens), return_lse=True, backend=backend)
    (out64, lse64), (out_lp, lse_lp) = reference_pair(case, q, k, v, seqlens)
    assert_close("out", out, out64, out_lp, case.dtype)
    assert_close("lse", lse, lse64, lse_lp, case.dtype)


@pytest.mark.parametrize("alpha", [1e38, 1e4 + 1, 0.999])
def test_alpha_out_of_range_is_refused(alpha):
    q, k, v, seqlens = make_inputs(CASE)
    with pytest.raises(ValueError, match=r"alpha must be finite and in \[1, 10000\]"):
        fold.attention(q, k, v, **kwargs_of(CASE.with_(alpha=alpha), seqlens))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_forward_only_refuses_autograd_and_runs_under_no_grad(name):
    q, k, v, seqlens = make_inputs(CASE, pad=0.0)
    tensors = dict(q=q, k=k, v=v)
    tensors[name].requires_grad_(True)
    with pytest.raises(ValueError, match=f"forward-only.*{name} require grad"):
        fold.attention(tensors["q"], tensors["k"], tensors["v"], **kwargs_of(CASE, seqlens))
    with torch.no_grad():
        out = fold.attention(tensors["q"], tensors["k"], tensors["v"], **kwargs_of(CASE, seqlens))
    assert not out.requires_grad


def test_tree_attention_is_forward_only():
    q = torch.randn(1, 2, 2, 16, requires_grad=True)
    kv = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="forward-only.*q require grad"):
        fold.tree_attention(q, kv, kv, kv[:, :2], kv[:, :2], tree_mask([-1, 0])[None])
