"""fold.far_pages: the per-page key bounds (built from scratch, updated in place) and the selection rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fold
from fold import far_pages
from reference import apply_rope
from reference.fold_attention import select_far_pages_ref
from reference.tolerance import check_close
from tests.helpers import Case, make_inputs, rope_of, to_pages



def _exact_bounds(k, lengths, page):
    """[B, T, Hkv, 2, d] by a Python loop over pages (float64 keys -> float32, as fold stores them)."""
    batch, max_len, heads_kv, head_dim = k.shape
    num_pages = -(-max_len // page)
    out = far_pages.empty_bounds(num_pages, heads_kv, head_dim, batch=batch)
    for b in range(batch):
        for t in range(num_pages):
            rows = k[b, t * page:min((t + 1) * page, lengths[b])].float()
            if len(rows):
                out[b, t, :, 0], out[b, t, :, 1] = rows.amax(0), rows.amin(0)
    return out


def test_empty_bounds_shapes_and_values():
    dense = far_pages.empty_bounds(5, 2, 8, batch=3)
    paged = far_pages.empty_bounds(7, 2, 8)
    assert dense.shape == (3, 5, 2, 2, 8) and paged.shape == (7, 2, 2, 8) and dense.dtype == torch.float32
    assert (dense[..., 0, :] == float("-inf")).all() and (paged[..., 1, :] == float("inf")).all()


@settings(max_examples=20)
@given(batch=st.integers(1, 3), max_len=st.integers(1, 120), page=st.sampled_from([1, 4, 16, 64]),
       chunk=st.integers(1, 40), seed=st.integers(0, 1000))
def test_update_over_appended_chunks_equals_bounds_from_scratch(batch, max_len, page, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, max_len, 2, 8, generator=g)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g)
    scratch = far_pages.page_bounds(k, page, cache_seqlens=lengths)
    assert torch.equal(scratch, _exact_bounds(k, lengths.tolist(), page))
    # dense: every sequence appends chunk entries a step, all sequences in one call
    grown = far_pages.empty_bounds(scratch.shape[1], 2, 8, batch=batch)
    for c0 in range(0, max_len, chunk):
        b, j = torch.meshgrid(torch.arange(batch), torch.arange(c0, min(c0 + chunk, max_len)), indexing="ij")
        keep = j < lengths[:, None]
        far_pages.update_bounds(grown, k[b[keep], j[keep]], far_page=page, positions=j[keep], batch_index=b[keep])
    assert torch.equal(grown, scratch)
    # paged: the same entries written through a slot mapping, bounds by physical block
    pages, table = to_pages(k, lengths, page, g)
    paged = far_pages.page_bounds(pages, page, cache_seqlens=lengths, block_table=table)
    grown = far_pages.empty_bounds(pages.shape[0], 2, 8)
    for c0 in range(0, max_len, chunk):
        b, j = torch.meshgrid(torch.arange(batch), torch.arange(c0, min(c0 + chunk, max_len)), indexing="ij")
        keep = j < lengths[:, None]
        slots = table[b[keep], j[keep] // page].long() * page + j[keep] % page
        far_pages.update_bounds(grown, k[b[keep], j[keep]], far_page=page, slot_mapping=slots)
    for bi in range(batch):
        for t in range(-(-int(lengths[bi]) // page)):
            assert torch.equal(paged[table[bi, t]], scratch[bi, t])
            assert torch.equal(grown[table[bi, t]], scratch[bi, t])


def test_a_write_at_offset_zero_resets_a_reused_page():
    bounds = far_pages.empty_bounds(4, 1, 4)
    big = torch.full((8, 1, 4), 100.0)
    far_pages.update_bounds(bounds, big, far_page=8, slot_mapping=torch.arange(16, 24))    # block 2 filled
    small = torch.randn(3, 1, 4)
    far_pages.update_bounds(bounds, small, far_page=8, slot_mapping=torch.tensor([16, 17, 18]))  # block 2 reused
    assert torch.equal(bounds[2, :, 0], small.amax(0)) and torch.equal(bounds[2, :, 1], small.amin(0))
    # an append that does not touch offset 0 keeps what is there
    more = torch.randn(2, 1, 4)
    far_pages.update_bounds(bounds, more, far_page=8, slot_mapping=torch.tensor([19, 20]))
    assert torch.equal(bounds[2, :, 0], torch.cat([small, more]).amax(0))
    assert torch.isinf(bounds[[0, 1, 3]]).all()                                        # untouched blocks


def test_negative_slots_are_skipped():
    bounds = far_pages.empty_bounds(3, 2, 4)
    keys = torch.randn(5, 2, 4)
    keys[1] = 1e6                                                                          # a padded entry
    slots = torch.tensor([0, -1, 1, -1, 5])
    far_pages.update_bounds(bounds, keys, far_page=4, slot_mapping=slots)
    real = keys[[0, 2, 4]]
    assert torch.equal(bounds[0, :, 0], real[:2].amax(0)) and torch.equal(bounds[1, :, 1], real[2])
    assert torch.isinf(bounds[2]).all() and bounds[..., 0, :].max() < 1e6


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotated_keys_give_the_bounds_of_the_unrotated_keys(interleaved):
    case = Case(batch=2, max_len=70, heads_kv=2, head_dim=32, rotary_dim=16, interleaved=interleaved,
                attention_factor=1.25, seed=3)
    _, k, _, _ = make_inputs(case)
    _, k_rot, _, _ = make_inputs(case.with_(keys_rotated=True))                # R_j k_j, factor included
    rope = rope_of(case)
    lengths = torch.tensor([70, 33])
    want = far_pages.page_bounds(k, 16, cache_seqlens=lengths)
    got = far_pages.page_bounds(k_rot, 16, cache_seqlens=lengths, keys_rotated=True, rope=rope)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    # PyTorch's own error: the reference's un-rotation in float32, bounds of what it gives back
    j = torch.arange(case.max_len)[:, None]
    unrotated32 = apply_rope(k_rot.float(), j, rope.inv_freq, inverse=True, rotary_dim=case.rotary_dim,
                             interleaved=interleaved, attention_factor=1.25)
    pytorch_lp = far_pages.page_bounds(unrotated32, 16, cache_seqlens=lengths)[finite]
    check_close("page_bounds(keys_rotated)", got[finite], want[finite].double(), pytorch_lp, torch.float32)
    grown = far_pages.empty_bounds(5, 2, 32, batch=2)
    for b, length in enumerate(lengths.tolist()):
        j = torch.arange(length)
        far_pages.update_bounds(grown, k_rot[b, :length], far_page=16, positions=j, batch_index=torch.full_like(j, b),
                                keys_rotated=True, rope=rope)
    check_close("update_bounds(keys_rotated)", grown[finite], want[finite].double(), pytorch_lp, torch.float32)
    assert torch.equal(torch.isfinite(grown), finite)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_keys_give_the_bounds_of_the_dequantized_keys(fp8):
    k8 = (torch.randn(1, 40, 1, 8) / 0.5).to(fp8)
    got = far_pages.page_bounds(k8, 8, k_scale=0.5)
    assert torch.equal(got, far_pages.page_bounds(k8.float() * 0.5, 8))


def test_bad_arguments_name_themselves():
    k = torch.randn(1, 16, 1, 8)
    with pytest.raises(ValueError, match="far_page"):
        far_pages.page_bounds(k, 0)
    with pytest.raises(TypeError, match="far_page"):
        far_pages.page_bounds(k, 2.0)
    with pytest.raises(ValueError, match="rope"):
        far_pages.page_bounds(k, 4, keys_rotated=True)
    with pytest.raises(ValueError, match="positions"):
        far_pages.update_bounds(far_pages.empty_bounds(4, 1, 8, batch=1), k[0], far_page=4)
    with pytest.raises(ValueError, match="keys"):
        far_pages.update_bounds(far_pages.empty_bounds(4, 2, 8), k[0], far_page=4, slot_mapping=torch.arange(16))
    with pytest.raises(TypeError, match="bounds"):
        far_pages.update_bounds(torch.zeros(4, 1, 2, 8, dtype=torch.float64), k[0], far_page=4,
                                slot_mapping=torch.arange(16))


@settings(max_examples=20)
@given(n_q=st.sampled_from([1, 3, 7]), page=st.sampled_from([1, 4, 16]), group=st.integers(1, 3),
       queries_rotated=st.booleans(), keys_rotated=st.booleans(), slots=st.integers(0, 6), seed=st.integers(0, 999),
       rank=st.sampled_from(far_pages.RANKS))
def test_select_pages_agrees_with_the_reference_rule(n_q, page, group, queries_rotated, keys_rotated, slots, seed,
                                                     rank):
    case = Case(batch=2, n_q=n_q, heads_kv=2, group=group, max_len=150, seqlens=(150, 61), window=9,
                attention_factor=1.25, keys_rotated=keys_rotated, queries_rotated=queries_rotated, seed=seed)
    q, k, _, seqlens = make_inputs(case)
    rope = rope_of(case)
    span = case.window + n_q
    budget = (-(-(n_q - 1) // page) + 1 + slots) * page
    bounds = far_pages.page_bounds(k, page, cache_seqlens=seqlens, keys_rotated=keys_rotated, rope=rope)
    q_far = far_pages.far_queries(q, rope, seqlens, window=case.window, max_len=case.max_len,
                                  queries_rotated=queries_rotated)
    got = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k, seqlens, keys_rotated=keys_rotated, rope=rope),
                                 span=span, far_page=page, num_slots=budget // page, scale=0.3, rank=rank)
    for b, length in enumerate(case.seqlens):
        want = select_far_pages_ref(q[b], k[b, :length], n=length - n_q, span=span, window=case.window, rope=rope,
                                    scale=0.3, far_budget=budget, far_page=page, keys_rotated=keys_rotated,
                                    queries_rotated=queries_rotated, rank=rank)
        for h in range(2):
            listed = got[b, h][got[b, h] >= 0].tolist()
            assert listed == sorted(listed)
            assert listed == torch.nonzero(want[h]).flatten().tolist(), (b, h)


def test_ties_go_to_the_lower_page():
    """Pages with identical keys have equal bounds: the lowest-indexed ones are read, every time."""
    k = torch.randn(1, 1, 1, 8).expand(1, 128, 1, 8).contiguous()
    q = torch.randn(1, 1, 1, 8)
    rope = fold.Rope.from_theta(10000.0, 8)
    bounds = far_pages.page_bounds(k, 8)
    q_far = far_pages.far_queries(q, rope, None, window=0, max_len=128, queries_rotated=False)
    for _ in range(3):
        got = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k), span=1, far_page=8, num_slots=3,
                                     scale=1.0)
        assert got.tolist() == [[[0, 1, 15]]]              # page 15 holds the block: always read


@settings(max_examples=6)
@given(group=st.integers(1, 3), slots=st.integers(1, 12), seed=st.integers(0, 999), rank=st.sampled_from(far_pages.RANKS))
def test_select_pages_ranks_the_best_groups_when_pages_outnumber_them(group, slots, seed, rank):
    """With more groups of pages than the selection ranks page by page (pages of 1 entry: 56 groups of
    16, of which max(2 K, 16) are ranked), the op and the reference still agree page for page, and a key
    planted to dominate the group's queries is read."""
    n_q, page = 4, 1
    case = Case(batch=1, n_q=n_q, heads_kv=2, group=group, max_len=900, window=9, seed=seed)
    q, k, _, _ = make_inputs(case)
    rope = rope_of(case)
    q_far = far_pages.far_queries(q, rope, None, window=case.window, max_len=case.max_len, queries_rotated=False)
    k[0, 123, 0] = 40 * q_far[0, 0, 0]         # entry 123: aligned with row 0's far query of KV head 0's group
    span = case.window + n_q
    budget = (-(-(n_q - 1) // page) + 1 + slots) * page
    assert far_pages.shortlist_size(budget // page) * far_pages.GROUP_PAGES < case.max_len - span
    bounds = far_pages.page_bounds(k, page, rope=rope)
    got = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k, rope=rope), span=span, far_page=page,
                                 num_slots=budget // page, scale=0.3, rank=rank)
    want = select_far_pages_ref(q[0], k[0], n=case.max_len - n_q, span=span, window=case.window, rope=rope,
                                scale=0.3, far_budget=budget, far_page=page, rank=rank)
    for h in range(2):
        listed = got[0, h][got[0, h] >= 0].tolist()
        assert listed == torch.nonzero(want[h]).flatten().tolist(), h
    assert 123 in got[0, 0].tolist()
    # a paged cache reads the same pages (logical indices) through its block table
    kp, table = to_pages(k, [case.max_len], page, torch.Generator().manual_seed(seed))
    paged = far_pages.page_bounds(kp, page, cache_seqlens=torch.tensor([case.max_len]), block_table=table, rope=rope)
    got_paged = far_pages.select_pages(q_far, paged, far_pages.KeyCache(kp, block_table=table, rope=rope), span=span,
                                       far_page=page, num_slots=budget // page, scale=0.3, rank=rank)
    assert torch.equal(got_paged, got)


def test_keys_rank_finds_the_entry_a_box_hides():
    """One far page holds a single key aligned with the query (logit 6 |q|, its box tight), the others keys
    spread in every dimension (largest logits ~2.5 |q|, boxes ~0.8 sqrt(d) times wider): the box bound
    ranks the spread pages first, rank="keys" reads the needle's page."""
    g = torch.Generator().manual_seed(3)
    d, page, pages = 64, 16, 12
    rope = fold.Rope.from_theta(10000.0, d)
    q = torch.randn(1, 1, 1, d, generator=g)
    q_far = far_pages.far_queries(q, rope, None, window=0, max_len=pages * page, queries_rotated=False)
    k = torch.randn(1, pages * page, 1, d, generator=g)
    k[0, 5 * page:6 * page] = 0.0
    k[0, 5 * page + 7, 0] = 6.0 * q_far[0, 0, 0] / q_far[0, 0, 0].norm()
    bounds = far_pages.page_bounds(k, page)
    common = dict(span=1, far_page=page, num_slots=2, scale=0.125)
    by_box = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k), **common)
    by_keys = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k, rope=rope), **common, rank="keys")
    assert 5 not in by_box[0, 0].tolist()
    assert by_keys[0, 0].tolist() == [5, pages - 1]            # the needle's page, and the block's own


def _strided_like(x, layout):
    """``x [A, B, H, d]`` stored three ways: contiguous; the K half of a joint ``[A, H, B, 2 d]`` tensor
    transposed to ``[A, B, H, d]`` (vLLM's CPU layout: rows on a grid of d); or with one element of padding
    per row (rows off that grid: the caller indexes)."""
    if layout == "contiguous":
        return x.clone()
    if layout == "joint":
        joint = torch.randn(x.shape[0], x.shape[2], x.shape[1], 2 * x.shape[3]).to(x.dtype)
        k = joint.transpose(1, 2)[..., :x.shape[3]]
    else:
        k = torch.randn(*x.shape[:3], x.shape[3] + 1).to(x.dtype)[..., 1:]
    k.copy_(x)
    return k


@pytest.mark.parametrize("layout", ["contiguous", "joint", "padded"])
def test_entry_rows_address_every_key(layout):
    x = torch.randn(3, 5, 2, 4)
    k = _strided_like(x, layout)
    rows, (s0, s1, s2) = far_pages._entry_rows(k)
    if layout == "padded":
        assert rows is None
        return
    for i in range(3):
        for j in range(5):
            for h in range(2):
                assert torch.equal(rows[i * s0 + j * s1 + h * s2], x[i, j, h])


@pytest.mark.parametrize("layout", ["joint", "padded"])
@pytest.mark.parametrize("max_len", [120, 900])
def test_keys_rank_reads_the_same_pages_from_any_key_layout(layout, max_len):
    """A cache stored as a view (vLLM's K half of a joint tensor, or rows off the grid) ranks exactly as
    the contiguous one, dense and paged, every page listed (120 entries) or a shortlist gathered (900)."""
    n_q, page, seed = 4, 1 if max_len == 900 else 4, 5
    case = Case(batch=2, n_q=n_q, heads_kv=2, group=2, max_len=max_len, seqlens=(max_len, max_len - 37), window=9,
                keys_rotated=True, seed=seed)
    q, k, _, seqlens = make_inputs(case)
    rope = rope_of(case)
    q_far = far_pages.far_queries(q, rope, seqlens, window=case.window, max_len=max_len, queries_rotated=False)
    common = dict(span=case.window + n_q, far_page=page, num_slots=5, scale=0.3, rank="keys")
    stored = dict(cache_seqlens=seqlens, keys_rotated=True, rope=rope)
    bounds = far_pages.page_bounds(k, page, cache_seqlens=seqlens, keys_rotated=True, rope=rope)
    want = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(k, **stored), **common)
    assert (want[..., 2:] >= 0).any()                   # some candidate was ranked and read
    got = far_pages.select_pages(q_far, bounds, far_pages.KeyCache(_strided_like(k, layout), **stored), **common)
    assert torch.equal(got, want)
    kp, table = to_pages(k, seqlens.tolist(), page, torch.Generator().manual_seed(seed))
    paged = far_pages.page_bounds(kp, page, cache_seqlens=seqlens, block_table=table, keys_rotated=True, rope=rope)
    for keys in (kp, _strided_like(kp, layout)):
        got = far_pages.select_pages(q_far, paged, far_pages.KeyCache(keys, block_table=table, **stored), **common)
        assert torch.equal(got, want)
