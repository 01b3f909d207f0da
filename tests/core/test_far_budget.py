"""fold.attention(..., far_budget=N): the far branch reads only the selected pages (torch path and Triton
kernels against the reference, exactness when the budget covers the far memory, the selection itself,
bad arguments)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fold
from fold import far_pages
from fold.config_lookup import use_config
from fold.kernels.fold_attention import FoldConfig
from reference import fold_attention_ref
from tests.helpers import INTERPRETED, Case, assert_close, kwargs_of, make_inputs, rope_of, to_pages


BACKENDS = ["torch", "triton"]


@st.composite
def budget_cases(draw, dtypes, max_len_cap=600):
    n_q = draw(st.sampled_from([1, 4, 7]))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    rotary_dim = draw(st.one_of(st.just(head_dim), st.integers(1, head_dim // 2).map(lambda x: 2 * x)))
    max_len = draw(st.integers(n_q, max_len_cap))
    batch = draw(st.integers(1, 3))
    seqlens = tuple(draw(st.lists(st.integers(n_q, max_len), min_size=batch, max_size=batch)))
    sliding = draw(st.one_of(st.none(), st.none(), st.integers(n_q, n_q + 40)))
    case = Case(
        batch=batch, n_q=n_q, heads_kv=draw(st.integers(1, 2)), group=draw(st.integers(1, 4)), head_dim=head_dim,
        rotary_dim=rotary_dim, interleaved=draw(st.booleans()), attention_factor=draw(st.sampled_from([1.0, 1.25])),
        max_len=max_len, seqlens=seqlens, window=draw(st.integers(0, 48)), alpha=draw(st.floats(1.0, 8.0)),
        keys_rotated=draw(st.booleans()), queries_rotated=draw(st.booleans()), sliding_window=sliding,
        causal=draw(st.booleans()) if sliding is not None else False, dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)))
    page = draw(st.sampled_from([1, 4, 16, 32]))
    slots = -(-(n_q - 1) // page) + 1 + draw(st.integers(0, 6))
    return case, page, slots * page + draw(st.integers(0, page - 1))


def check_budget_against_reference(case, page, budget, backend, *, paged=False, bounds_given=False, rank="bound"):
    q, k, v, seqlens = make_inputs(case, pad=0.0 if paged else float("nan"))
    kw = kwargs_of(case, seqlens)
    ref = dict(far_budget=budget, far_page=page, far_rank=rank)
    truth = fold_attention_ref(q, k, v, **kw, **ref)
    twin = fold_attention_ref(q, k, v, **kw, **ref, upcast=False)
    rope = rope_of(case)
    if paged:
        (k, table), (v, _) = (to_pages(x, seqlens, page, torch.Generator().manual_seed(case.seed)) for x in (k, v))
        kw["block_table"] = table
    if bounds_given:
        ref["far_bounds"] = far_pages.page_bounds(k, page, cache_seqlens=seqlens, block_table=kw.get("block_table"),
                                                  keys_rotated=case.keys_rotated, rope=rope)
    out, lse = fold.attention(q, k, v, **kw, **ref, return_lse=True, backend=backend)
    assert out.dtype == case.dtype and out.shape == q.shape
    assert_close("out", out, truth[0], twin[0], case.dtype)
    assert_close("lse", lse, truth[1], twin[1], case.dtype)


RANK = st.sampled_from(far_pages.RANKS)


@given(spec=budget_cases(dtypes=[torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       paged=st.booleans(), bounds_given=st.booleans(), rank=RANK)
@example(spec=(Case(batch=2, n_q=7, heads_kv=2, group=4, head_dim=64, max_len=900, seqlens=(900, 300), window=32,
                    keys_rotated=True, queries_rotated=True, attention_factor=1.25), 16, 96),
         paged=True, bounds_given=True, rank="bound")
@example(spec=(Case(batch=2, n_q=7, heads_kv=2, group=4, head_dim=64, max_len=900, seqlens=(900, 300), window=32,
                    keys_rotated=True, queries_rotated=True, attention_factor=1.25), 16, 96),
         paged=True, bounds_given=False, rank="keys")
def test_torch_matches_reference(spec, paged, bounds_given, rank):
    case, page, budget = spec
    check_budget_against_reference(case, page, budget, "torch", paged=paged, bounds_given=bounds_given, rank=rank)


configs = st.builds(FoldConfig, block_m=st.sampled_from([16, 32, 64]), block_n=st.sampled_from([16, 32, 64]),
                    num_splits=st.sampled_from([1, 2, 3, 8]), num_warps=st.just(4), num_stages=st.just(2))


@INTERPRETED
@given(spec=budget_cases(dtypes=[torch.float32, torch.float16, torch.bfloat16], max_len_cap=400),
       paged=st.booleans(), bounds_given=st.booleans(), config=configs, rank=RANK)
@example(spec=(Case(batch=2, n_q=7, heads_kv=2, group=4, head_dim=64, rotary_dim=40, interleaved=True, max_len=500,
                    seqlens=(500, 200), window=24, keys_rotated=True, queries_rotated=True, attention_factor=1.25),
               16, 80), paged=True, bounds_given=True, config=FoldConfig(32, 64, 8, 4, 2), rank="keys")
@example(spec=(Case(batch=1, n_q=4, group=2, max_len=300, window=8, sliding_window=12, causal=True), 4, 20),
         paged=False, bounds_given=False, config=FoldConfig(16, 16, 3, 4, 2), rank="bound")
def test_triton_matches_reference(spec, paged, bounds_given, config, rank):
    """The far launch over a page list (in the interpreter; bf16 through its upcast path) against the reference."""
    case, page, budget = spec
    with use_config(config):
        check_budget_against_reference(case, page, budget, "triton", paged=paged, bounds_given=bounds_given,
                                       rank=rank)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keys_rotated", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_a_budget_covering_the_far_memory_is_fold_exactly(backend, keys_rotated, paged):
    case = Case(batch=2, n_q=4, heads_kv=2, group=2, max_len=256, seqlens=(256, 100), window=20,
                keys_rotated=keys_rotated, attention_factor=1.25)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    kw = kwargs_of(case, seqlens)
    if paged:
        (k, table), (v, _) = (to_pages(x, seqlens, 16, torch.Generator().manual_seed(1)) for x in (k, v))
        kw["block_table"] = table
    full = fold.attention(q, k, v, **kw, return_lse=True, backend=backend)
    far_size = 256 - (case.window + case.n_q)                      # the longest sequence's far entries
    for budget in (-(-far_size // 16) * 16, 10_000):
        got = fold.attention(q, k, v, **kw, far_budget=budget, far_page=16, return_lse=True, backend=backend)
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_budget_covering_one_sequence_reads_all_of_it(backend):
    """Sequence 1's far memory fits the budget, sequence 0's does not: sequence 1 is FOLD (torch: exactly)."""
    case = Case(batch=2, n_q=4, group=2, max_len=400, seqlens=(400, 90), window=16)
    q, k, v, seqlens = make_inputs(case)
    kw = kwargs_of(case, seqlens)
    full = fold.attention(q, k, v, **kw, backend=backend)
    got = fold.attention(q, k, v, **kw, far_budget=96, far_page=16, backend=backend)
    if backend == "torch":
        assert torch.equal(got[1], full[1])
    else:
        truth = full[1].double()
        assert_close("covered sequence", got[1], truth, truth, case.dtype)
    assert not torch.allclose(got[0], full[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keys_rotated", [False, True])
def test_a_dominant_key_gets_its_page_read(backend, keys_rotated):
    """A key aligned with every query, planted in one far page, makes that page the top bound: with one
    candidate slot, the read is the straddling pages plus that page (and matches the reference)."""
    case = Case(n_q=4, group=2, head_dim=32, max_len=300, window=16, keys_rotated=keys_rotated, alpha=4.0, seed=5)
    q, k, v, _ = make_inputs(case)
    planted_page, page = 5, 16
    rope = rope_of(case)
    q_far = far_pages.far_queries(q, rope, None, window=case.window, max_len=300, queries_rotated=False)
    key = q_far[0].mean((0, 1))                                                     # [d] the far queries' direction
    key = 8 * key / key.norm()
    factor = torch.ones(32)
    factor[:case.rotary_dim] = case.attention_factor
    unrotated = key / factor                                                         # R_0 k = f k
    if keys_rotated:
        from reference import apply_rope
        unrotated = apply_rope(unrotated.double(), torch.tensor([planted_page * page + 3]), rope.inv_freq,
                               rotary_dim=rope.rotary_dim, interleaved=rope.interleaved,
                               attention_factor=rope.attention_factor)
    k[0, planted_page * page + 3, 0] = unrotated.to(k.dtype)
    kw = kwargs_of(case, None)
    budget = 2 * page                                                   # 1 straddling page + 1 candidate
    bounds = far_pages.page_bounds(k, page, keys_rotated=keys_rotated, rope=rope)
    chosen = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k), span=case.window + 4, far_page=page,
                                    num_slots=2, scale=1.0)
    n = 300 - 4
    straddling = list(range((n - case.window - 4 + 1) // page, -(-(n - case.window - 1) // page)))
    assert chosen[0, 0].tolist() == sorted([planted_page] + straddling)
    out = fold.attention(q, k, v, **kw, far_budget=budget, far_page=page, backend=backend)
    truth = fold_attention_ref(q, k, v, **kw, far_budget=budget, far_page=page)
    twin = fold_attention_ref(q, k, v, **kw, far_budget=budget, far_page=page, upcast=False)
    assert_close("out", out, truth[0], twin[0], case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_bounds_read_the_same_pages_every_time(backend):
    """Identical pages tie: the lower ones are read, and repeated calls agree bit for bit."""
    case = Case(n_q=4, group=2, head_dim=32, max_len=320, window=16)
    q, k, v, _ = make_inputs(case)
    k[0, :256] = k[0, :16].repeat(16, 1, 1)                                         # 16 identical pages
    v[0, :256] = torch.randn(256, 1, 32)
    kw = kwargs_of(case, None)
    outs = [fold.attention(q, k, v, **kw, far_budget=64, far_page=16, backend=backend) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    truth = fold_attention_ref(q, k, v, **kw, far_budget=64, far_page=16)
    twin = fold_attention_ref(q, k, v, **kw, far_budget=64, far_page=16, upcast=False)
    assert_close("tied pages", outs[0], truth[0], twin[0], case.dtype)


@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(spec=budget_cases(dtypes=[torch.float32, torch.float16], max_len_cap=300),
       fp8=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]), k_scale=st.floats(0.05, 4.0),
       backend=st.sampled_from(BACKENDS), paged=st.booleans())
def test_fp8_cache_budget_reads_as_its_dequantized_cache(spec, fp8, k_scale, backend, paged):
    case, page, budget = spec
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    k8, v8 = (k.double() / k_scale).to(fp8), (v.double() / 0.5).to(fp8)
    kw = kwargs_of(case, seqlens)
    ref = dict(far_budget=budget, far_page=page)
    truth, _ = fold_attention_ref(q, k8.double() * k_scale, v8.double() * 0.5, **kw, **ref)
    twin, _ = fold_attention_ref(q, k8, v8, **kw, **ref, k_scale=k_scale, v_scale=0.5, upcast=False)
    if paged:
        (k8, table), (v8, _) = (to_pages(x.double(), seqlens, page, torch.Generator().manual_seed(case.seed))
                                for x in (k8, v8))
        k8, v8 = k8.to(fp8), v8.to(fp8)
        kw["block_table"] = table
    with use_config(FoldConfig(16, 32, 2, 4, 2)):
        out = fold.attention(q, k8, v8, **kw, **ref, k_scale=k_scale, v_scale=0.5, backend=backend)
    assert_close("fp8 out", out, truth, twin, case.dtype)


def test_bad_arguments_name_themselves():
    case = Case(n_q=7, max_len=200, window=16)
    q, k, v, _ = make_inputs(case)
    kw = kwargs_of(case, None)
    with pytest.raises(ValueError, match="far_budget"):
        fold.attention(q, k, v, **kw, far_budget=16, far_page=16)             # 2 straddling pages needed
    with pytest.raises(TypeError, match="far_budget"):
        fold.attention(q, k, v, **kw, far_budget=64.0)
    with pytest.raises(TypeError, match="far_budget"):
        fold.attention(q, k, v, **kw, far_budget=True)
    with pytest.raises(ValueError, match="far_page"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page=0)
    with pytest.raises(TypeError, match="far_page"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page="16")
    for position in ("none", "fixed_distance"):
        with pytest.raises(ValueError, match="far_position"):
            fold.attention(q, k, v, **dict(kw, far_position=position), far_budget=64, far_page=16)
    with pytest.raises(ValueError, match="far_bounds"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page=16, far_bounds=far_pages.empty_bounds(3, 1, 32, batch=1))
    with pytest.raises(TypeError, match="far_bounds"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page=16,
                       far_bounds=far_pages.empty_bounds(13, 1, 32, batch=1).double())
    with pytest.raises(TypeError, match="far_bounds"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page=16, far_bounds=[0.0])
    (kp, table), (vp, _) = (to_pages(x, [200], 16, torch.Generator().manual_seed(0)) for x in (k, v))
    paged = dict(kw, cache_seqlens=torch.tensor([200], dtype=torch.int32), block_table=table)
    with pytest.raises(ValueError, match="far_page"):
        fold.attention(q, kp, vp, **paged, far_budget=64, far_page=32)
    with pytest.raises(ValueError, match="far_bounds"):
        fold.attention(q, kp, vp, **paged, far_budget=64, far_page=16,
                       far_bounds=far_pages.empty_bounds(13, 1, 32, batch=1))
    with pytest.raises(ValueError, match="far_rank"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page=16, far_rank="box")
    with pytest.raises(TypeError, match="far_rank"):
        fold.attention(q, k, v, **kw, far_budget=64, far_page=16, far_rank=None)
    # without a budget, far_page is the default of any page size and far_bounds is ignored
    fold.attention(q, kp, vp, **paged)


@pytest.mark.parametrize("rank", far_pages.RANKS)
def test_the_torch_path_selects_without_host_reads_beyond_its_own(rank):
    """The selection (fold.attention -> far_pages) reads nothing on the host; the torch path's own reads
    (cache_seqlens.tolist()) are what they were without a budget."""
    from tests.helpers import HostReads

    case = Case(batch=2, n_q=4, group=2, max_len=300, seqlens=(300, 120), window=16, keys_rotated=True)
    q, k, v, seqlens = make_inputs(case)
    kw = dict(kwargs_of(case, seqlens), check_ranges=False)
    fold.attention(q, k, v, **kw, backend="torch")                    # the torch path's Rope, kept from here on
    with HostReads() as plain:
        fold.attention(q, k, v, **kw, backend="torch")
    with HostReads() as budgeted:
        fold.attention(q, k, v, **kw, far_budget=48, far_page=16, far_rank=rank, backend="torch")
    assert [c for c in budgeted.calls if c[1] == "fold.far_pages"] == []
    assert sorted(budgeted.calls) == sorted(plain.calls)


@pytest.mark.parametrize("bounds_given,rank", [(False, "bound"), (True, "bound"), (True, "keys")])
@pytest.mark.parametrize("keys_rotated", [False, True])
def test_the_triton_path_reads_no_tensor_on_the_host(bounds_given, rank, keys_rotated):
    """A budgeted read as engines call it (paged, range checks off): bounds, selection and launches
    read nothing on the host, so a CUDA graph can capture it."""
    from tests.helpers import HostReads

    case = Case(batch=2, n_q=4, heads_kv=2, group=2, max_len=320, seqlens=(320, 150), window=16,
                keys_rotated=keys_rotated, queries_rotated=keys_rotated)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    (kp, table), (vp, _) = (to_pages(x, seqlens, 16, torch.Generator().manual_seed(2)) for x in (k, v))
    rope = rope_of(case)
    bounds = (far_pages.page_bounds(kp, 16, cache_seqlens=seqlens, block_table=table, keys_rotated=keys_rotated,
                                    rope=rope) if bounds_given else None)
    kw = dict(kwargs_of(case, seqlens), block_table=table, check_ranges=False)
    with HostReads() as reads:
        out = fold.attention(q, kp, vp, **kw, far_budget=64, far_page=16, far_bounds=bounds, far_rank=rank,
                             backend="triton")
        slots = torch.full((6,), -1)
        slots[:3] = torch.tensor([0, 17, 33])
        far_pages.update_bounds(far_pages.empty_bounds(kp.shape[0], 2, 32), kp[0, :6], far_page=16,
                                slot_mapping=slots, positions=torch.arange(6), keys_rotated=keys_rotated, rope=rope)
    assert reads.calls == [] and torch.isfinite(out).all()
