"""fold.attention: both backends against the reference, and the properties the paper promises."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fold
from fold.config_lookup import use_config
from fold.kernels.fold_attention import FoldConfig
from reference import apply_rope, fold_attention_ref
from tests.helpers import (INTERPRETED, Case, assert_close, cases, check_against_reference, configs, kwargs_of,
                           make_inputs, reference_pair, rope_of, to_pages)


@INTERPRETED
@given(case=cases(dtypes=[torch.float32, torch.float16, torch.bfloat16]), config=configs)
@example(case=Case(n_q=16, group=8, head_dim=128, max_len=2048, window=64), config=FoldConfig(128, 64, 8, 4, 2))
@example(case=Case(batch=3, n_q=7, heads_kv=2, group=4, max_len=300, seqlens=(7, 300, 150), window=20,
                   keys_rotated=True), config=FoldConfig(16, 16, 16, 4, 2))
@example(case=Case(batch=2, n_q=10, heads_kv=1, group=4, head_dim=64, rotary_dim=40, interleaved=True, max_len=700,
                   seqlens=(700, 90), window=30, keys_rotated=True), config=FoldConfig(64, 64, 128, 4, 2))
@example(case=Case(batch=2, n_q=4, group=2, head_dim=80, rotary_dim=64, max_len=333, seqlens=(333, 41), window=300),
         config=FoldConfig(16, 128, 3, 4, 2))
@example(case=Case(batch=2, n_q=7, heads_kv=2, group=2, max_len=260, seqlens=(260, 40), window=16, sliding_window=33,
                   causal=True, keys_rotated=True, queries_rotated=True), config=FoldConfig(16, 16, 4, 4, 2))
@example(case=Case(batch=2, n_q=4, group=3, max_len=150, seqlens=(150, 9), window=8, sliding_window=4, causal=True,
                   far_position="none"), config=FoldConfig(32, 32, 2, 4, 2))
@example(case=Case(batch=2, n_q=7, heads_kv=2, group=2, head_dim=64, max_len=400, seqlens=(400, 60), window=32,
                   alpha=3.0, softcap=2.5, keys_rotated=True, dtype=torch.float16), config=FoldConfig(32, 32, 3, 4, 2))
def test_triton_matches_reference(case, config):
    """The fused kernels (in the interpreter; bf16 through its upcast path) against the float64 reference."""
    with use_config(config):
        check_against_reference(case, backend="triton")


@given(case=cases(dtypes=[torch.float32, torch.float16, torch.bfloat16, torch.float64], max_len_cap=6000))
@example(case=Case(batch=2, n_q=10, heads_kv=2, group=4, head_dim=128, max_len=9000, seqlens=(9000, 5000),
                   window=2048, dtype=torch.bfloat16, keys_rotated=True))
@example(case=Case(batch=2, n_q=7, heads_kv=2, group=2, max_len=3000, seqlens=(3000, 40), window=16, sliding_window=512,
                   causal=True, keys_rotated=True, queries_rotated=True))
@example(case=Case(batch=2, n_q=7, heads_kv=2, group=2, head_dim=64, max_len=3000, seqlens=(3000, 60), window=32,
                   alpha=3.0, softcap=2.5, queries_rotated=True, dtype=torch.bfloat16))
def test_torch_matches_reference(case):
    check_against_reference(case, backend="torch")


def _rotated(x, positions, rope):
    return apply_rope(x.to(torch.float64), positions, rope.inv_freq, rotary_dim=rope.rotary_dim,
                      interleaved=rope.interleaved, attention_factor=rope.attention_factor)


def _sdpa(q, k, v, group):
    # q [n_q, Hq, d], k/v [L, Hkv, d] float64 -> [n_q, Hq, d]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
                                         v.transpose(0, 1).repeat_interleave(group, 0))
    return out.transpose(0, 1)


BACKENDS = ["torch", "triton"]
PROPERTY_CASE = Case(batch=2, n_q=7, heads_kv=2, group=3, head_dim=64, rotary_dim=48, max_len=200,
                     seqlens=(200, 90), window=24, alpha=3.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keys_rotated", [False, True])
def test_window_covering_everything_is_plain_rope_attention(backend, keys_rotated):
    """W >= L: no far memory, the original drafter's read; checked against SDPA on rotated q, k."""
    case = PROPERTY_CASE.with_(window=500, keys_rotated=keys_rotated, interleaved=True)
    q, k, v, seqlens = make_inputs(case)
    out = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend=backend)
    rope = rope_of(case)
    for b, length in enumerate(case.seqlens):
        n = length - case.n_q
        kb = k[b, :length].to(torch.float64)
        if not keys_rotated:
            kb = _rotated(kb, torch.arange(length)[:, None], rope)
        qb = _rotated(q[b], torch.arange(n, length)[:, None], rope)
        want = _sdpa(qb, kb, v[b, :length].to(torch.float64), case.group)
        assert_close(f"out[{b}]", out[b], want, want, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keys_rotated", [False, True])
@pytest.mark.parametrize("far_position", ["shared", "fixed_distance"])
def test_alpha_one_is_one_softmax_over_position_mapped_logits(backend, keys_rotated, far_position):
    """alpha = 1: far entries are ordinary entries at the shared virtual position n - D (FOLD), or at
    p - D for row p (``far_position="fixed_distance"``, ReRoPE's rule)."""
    case = PROPERTY_CASE.with_(alpha=1.0, keys_rotated=keys_rotated, far_position=far_position)
    q, k, v, seqlens = make_inputs(case)
    out = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend=backend)
    if keys_rotated:                                                          # the same keys, unrotated
        _, k, _, _ = make_inputs(case.with_(keys_rotated=False))
    rope = rope_of(case)
    d_pos = case.window + case.n_q
    for b, length in enumerate(case.seqlens):
        n = length - case.n_q
        j = torch.arange(length)
        for r in range(case.n_q):
            p = n + r
            virtual = n - d_pos if far_position == "shared" else p - d_pos
            mapped = torch.where(p - j < d_pos, j, virtual)                    # far -> virtual position
            kb = _rotated(k[b, :length], mapped[:, None], rope)
            qb = _rotated(q[b, r:r + 1], torch.tensor([[p]]), rope)
            want = _sdpa(qb, kb, v[b, :length].to(torch.float64), case.group)
            assert_close(f"out[{b}, {r}]", out[b, r:r + 1], want, want, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_layouts_agree(backend):
    case = PROPERTY_CASE.with_(attention_factor=1.25)
    q, k, v, seqlens = make_inputs(case)
    _, k_rot, _, _ = make_inputs(case.with_(keys_rotated=True))
    plain = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend=backend)
    rotated = fold.attention(q, k_rot, v, **kwargs_of(case.with_(keys_rotated=True), seqlens), backend=backend)
    truth = plain.to(torch.float64)
    assert_close("rotated vs unrotated layout", rotated, truth, truth, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keys_rotated", [False, True])
@pytest.mark.parametrize("far_position", ["shared", "fixed_distance"])
def test_query_layouts_agree(backend, keys_rotated, far_position):
    """Queries rotated at their true positions (as engines hand them over) give the read of the
    unrotated queries, window and far memory alike, with a YaRN-style factor on both."""
    case = PROPERTY_CASE.with_(attention_factor=1.25, keys_rotated=keys_rotated, seqlens=(200, 23),
                               far_position=far_position)
    q, k, v, seqlens = make_inputs(case)
    q_rot, _, _, _ = make_inputs(case.with_(queries_rotated=True))
    assert not torch.allclose(q, q_rot)
    rotated, lse = fold.attention(q_rot, k, v, **kwargs_of(case.with_(queries_rotated=True), seqlens),
                                  return_lse=True, backend=backend)
    truth, lse_truth = (x.to(torch.float64) for x in fold.attention(
        q, k, v, **kwargs_of(case, seqlens), return_lse=True, backend=backend))
    assert_close("rotated vs unrotated queries", rotated, truth, truth, case.dtype)
    assert_close("lse", lse, lse_truth, lse_truth, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_padding_beyond_seqlens_changes_nothing(backend):
    case = PROPERTY_CASE
    q, k, v, seqlens = make_inputs(case, pad=float("nan"))
    _, k0, v0, _ = make_inputs(case, pad=0.0)
    out_nan = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend=backend)
    out_zero = fold.attention(q, k0, v0, **kwargs_of(case, seqlens), backend=backend)
    assert torch.equal(out_nan, out_zero)


@pytest.mark.parametrize("backend", BACKENDS)
def test_permuting_the_batch_permutes_the_output(backend):
    case = PROPERTY_CASE.with_(batch=3, seqlens=(200, 90, 31))
    q, k, v, seqlens = make_inputs(case)
    perm = torch.tensor([2, 0, 1])
    out = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend=backend)
    out_perm = fold.attention(q[perm], k[perm], v[perm], **kwargs_of(case, seqlens[perm]), backend=backend)
    assert torch.equal(out_perm, out[perm])


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_lse_merges_with_another_segment(backend):
    """(out, lse) is a true attention state: merged with a state over extra keys it gives the
    softmax over the union, computed here in float64 from the reference's masses."""
    case = PROPERTY_CASE
    q, k, v, seqlens = make_inputs(case)
    out, lse = fold.attention(q, k, v, **kwargs_of(case, seqlens), return_lse=True, backend=backend)
    g = torch.Generator().manual_seed(7)
    o2 = torch.randn(out.shape, generator=g, dtype=torch.float64)
    lse2 = torch.randn(lse.shape, generator=g, dtype=torch.float64) + lse.to(torch.float64)
    lse2[0, 0] = float("-inf")                                   # an empty segment for one row
    merged, merged_lse = fold.merge_states([out, o2.to(out.dtype)], [lse, lse2.float()])

    from reference import fold_attention_ref
    out64, lse64 = fold_attention_ref(q, k, v, **kwargs_of(case, seqlens))
    total = torch.logaddexp(lse64, lse2)
    want = (torch.exp(lse64 - total)[..., None] * out64 + torch.exp(lse2 - total)[..., None] * o2)
    assert_close("merged out", merged, want, want, case.dtype)
    assert_close("merged lse", merged_lse, total, total, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_within_window_is_the_original_drafter(backend):
    """n <= W: nothing is far, so alpha cannot matter."""
    case = PROPERTY_CASE.with_(window=193)                      # max n = 200 - 7 = 193
    q, k, v, seqlens = make_inputs(case)
    a = fold.attention(q, k, v, **kwargs_of(case.with_(alpha=1.0), seqlens), backend=backend)
    b = fold.attention(q, k, v, **kwargs_of(case.with_(alpha=7.5), seqlens), backend=backend)
    assert torch.equal(a, b)


def test_far_memory_mass_is_bounded_by_alpha_root():
    """Paper §3.3: with N far entries of equal logit s, Z_F = N^(1/alpha) e^s."""
    case = Case(n_q=1, head_dim=16, rotary_dim=16, max_len=1 + 64 + 1000, window=64, alpha=4.0, dtype=torch.float64)
    q = torch.zeros(1, 1, 1, 16, dtype=torch.float64)          # every logit is 0
    k = torch.randn(1, case.max_len, 1, 16, dtype=torch.float64)
    v = torch.randn(1, case.max_len, 1, 16, dtype=torch.float64)
    _, lse = fold.attention(q, k, v, **kwargs_of(case, None), return_lse=True, backend="torch")
    n_far = case.max_len - (case.window + case.n_q)            # row 0: j <= n - D
    n_window = case.window + case.n_q
    assert math.isclose(lse.item(), math.log(n_window + n_far ** (1 / case.alpha)), rel_tol=1e-12)


def test_auto_backend_is_torch_on_cpu():
    case = PROPERTY_CASE
    q, k, v, seqlens = make_inputs(case)
    auto = fold.attention(q, k, v, **kwargs_of(case, seqlens))
    torch_path = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend="torch")
    assert torch.equal(auto, torch_path)


def test_nan_poisoning_is_active():
    """The conftest hook that makes unwritten outputs visible must really poison fold's allocations."""
    scope = {"__name__": "fold._probe", "torch": torch}
    exec("x = torch.empty(4)\ny = torch.empty_like(x)", scope)
    assert torch.isnan(scope["x"]).all() and torch.isnan(scope["y"]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (80, 64), (96, 96), (256, 128)])
def test_head_dims_beyond_powers_of_two(backend, head_dim, rotary_dim):
    """Tiles are padded to powers of two >= 16 and masked; real models use 80, 96, 256."""
    case = PROPERTY_CASE.with_(head_dim=head_dim, rotary_dim=rotary_dim, max_len=120, seqlens=(120, 33))
    with use_config(FoldConfig(32, 32, 2, 4, 2)):
        check_against_reference(case, backend=backend)


@pytest.mark.parametrize("keys_rotated", [False, True])
@pytest.mark.parametrize("where", ["q", "far key", "window key", "far value", "window value"])
def test_triton_propagates_nan_in_valid_inputs(where, keys_rotated):
    """A NaN in a valid query row, key or value reaches exactly the outputs it reaches in the
    reference (as in SDPA) instead of being masked away; NaN padding is covered above."""
    from reference import fold_attention_ref

    case = PROPERTY_CASE.with_(keys_rotated=keys_rotated, seqlens=(200, 150))
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    far, win = 3, 150 - case.n_q - 2                   # of sequence 1: a far entry and a window entry
    if where == "q":
        q[1, 2, 1] = float("nan")
    else:
        x = k if "key" in where else v
        x[1, far if "far" in where else win, 0, 5] = float("nan")
    out = fold.attention(q, k, v, **kwargs_of(case, seqlens), backend="triton")
    want, _ = fold_attention_ref(q, k, v, **kwargs_of(case, seqlens))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).any()
    assert torch.equal(torch.isnan(out), torch.isnan(want))


@settings(max_examples=12)
@given(case=cases(dtypes=[torch.float32, torch.bfloat16], max_len_cap=400), page_size=st.sampled_from([1, 5, 16, 64]),
       config=configs)
def test_triton_reads_a_paged_cache_as_the_contiguous_one(case, page_size, config):
    """block_table (flash-attn's convention): shuffled pages, garbage in unused slots and table entries."""
    case = case.with_(seqlens=case.seqlens or (case.max_len,) * case.batch)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    k_pages, table = to_pages(k, seqlens, page_size, torch.Generator().manual_seed(case.seed))
    v_pages, _ = to_pages(v, seqlens, page_size, torch.Generator().manual_seed(case.seed))
    with use_config(config):
        out, lse = fold.attention(q, k_pages, v_pages, **kwargs_of(case, seqlens), block_table=table,
                                  return_lse=True, backend="triton")
    (out64, lse64), (out_lp, lse_lp) = reference_pair(case, q, k, v, seqlens)
    assert_close("paged out", out, out64, out_lp, case.dtype)
    assert_close("paged lse", lse, lse64, lse_lp, case.dtype)


@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(case=cases(dtypes=[torch.float32, torch.float16, torch.bfloat16], max_len_cap=400),
       fp8=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]), k_scale=st.floats(0.05, 4.0),
       v_scale=st.floats(0.05, 4.0), backend=st.sampled_from(BACKENDS), paged=st.booleans())
def test_fp8_cache_reads_as_its_dequantized_cache(case, fp8, k_scale, v_scale, backend, paged):
    """An FP8 cache holding k / k_scale and v / v_scale (vLLM's layout): the read equals the reference
    on the dequantized cache, within PyTorch's own error on the same FP8 cache in q's dtype."""
    case = case.with_(seqlens=case.seqlens or (case.max_len,) * case.batch)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    k8, v8 = (k.double() / k_scale).to(fp8), (v.double() / v_scale).to(fp8)
    kw = kwargs_of(case, seqlens)
    truth, _ = fold_attention_ref(q, k8.double() * k_scale, v8.double() * v_scale, **kw)
    twin, _ = fold_attention_ref(q, k8, v8, **kw, k_scale=k_scale, v_scale=v_scale, upcast=False)
    if paged:
        (k8, table), (v8, _) = (to_pages(x.double(), seqlens, 16, torch.Generator().manual_seed(case.seed))
                                for x in (k8, v8))                      # the same pages for keys and values
        k8, v8 = k8.to(fp8), v8.to(fp8)                     # unused slots: garbage, NaN where out of range
        kw["block_table"] = table
    with use_config(FoldConfig(16, 32, 2, 4, 2)):
        out = fold.attention(q, k8, v8, **kw, k_scale=k_scale, v_scale=v_scale, backend=backend)
    assert_close("fp8 out", out, truth, twin, case.dtype)
