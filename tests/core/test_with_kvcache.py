"""``fold.attention_with_kvcache``: the append form against ``reference.attention_with_kvcache_ref``.

The new rows are written where the reference writes them (values exactly; keys exactly, or by the
tolerance rule when rotated there), nothing else of the cache changes, and the read equals the
reference's over every sequence's entries ``[leftpad, cache_seqlens + n_new)``. Entries outside that
range are NaN, so a read of one shows.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fold
from fold.kernels.fold_attention import FoldConfig
from fold.config_lookup import use_config
from reference import attention_with_kvcache_ref
from reference.tolerance import check_close
from tests.helpers import INTERPRETED


@st.composite
def appends(draw):
    batch, n_q = draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 8]))
    heads_kv, group, head_dim = draw(st.integers(1, 2)), draw(st.sampled_from([1, 3])), draw(st.sampled_from([16, 32]))
    n_new = draw(st.integers(0, n_q))
    max_len = draw(st.integers(n_q + 4, 200))
    paged = draw(st.booleans())
    page = draw(st.sampled_from([1, 16, 64])) if paged else 0
    if paged:
        max_len = -(-max_len // page) * page
    lay = dict(leftpad=None if paged else draw(st.one_of(st.none(), st.just(True))),
               batch_idx=None if paged else draw(st.one_of(st.none(), st.just(True))))
    ends, starts = [], []
    for _ in range(batch):                         # each sequence: [start, end + n_new) holds >= n_q entries
        start = draw(st.integers(0, max_len - n_q)) if lay["leftpad"] else 0
        end = draw(st.integers(max(start, start + n_q - n_new), max_len - n_new))
        starts.append(start)
        ends.append(end)
    return dict(batch=batch, n_q=n_q, heads_kv=heads_kv, group=group, head_dim=head_dim, n_new=n_new,
                max_len=max_len, page=page, starts=starts, ends=ends, batch_idx=lay["batch_idx"],
                rotate=draw(st.booleans()), window=draw(st.integers(0, 40)), alpha=draw(st.floats(1.0, 4.0)),
                causal=draw(st.booleans()), softcap=draw(st.one_of(st.none(), st.floats(1.0, 20.0))),
                dtype=draw(st.sampled_from([torch.float32, torch.float16])), seed=draw(st.integers(0, 2**16)))


def build(c):
    """The case's tensors: q, the cache (NaN outside every sequence's entries), k, v, and the call's arguments."""
    g = torch.Generator().manual_seed(c["seed"])
    batch, d, hkv = c["batch"], c["head_dim"], c["heads_kv"]
    rows = 2 * batch if c["batch_idx"] else batch
    q = torch.randn(batch, c["n_q"], hkv * c["group"], d, generator=g).to(c["dtype"])
    k_new = torch.randn(batch, c["n_new"], hkv, d, generator=g).to(c["dtype"])
    v_new = torch.randn(batch, c["n_new"], hkv, d, generator=g).to(c["dtype"])
    dense_k = torch.full((rows, c["max_len"], hkv, d), float("nan"))
    dense_v = dense_k.clone()
    order = torch.randperm(rows, generator=g)[:batch] if c["batch_idx"] else torch.arange(batch)
    for b in range(batch):
        lo, hi = c["starts"][b], c["ends"][b]
        dense_k[order[b], lo:hi] = torch.randn(hi - lo, hkv, d, generator=g)
        dense_v[order[b], lo:hi] = torch.randn(hi - lo, hkv, d, generator=g)
    args = dict(cache_seqlens=torch.tensor(c["ends"], dtype=torch.int32),
                rope=fold.Rope.from_theta(10000.0, d), rotate_new_keys=c["rotate"], window=c["window"],
                alpha=c["alpha"], keys_rotated=c["rotate"], causal=c["causal"], softcap=c["softcap"])
    if c["batch_idx"]:
        args["cache_batch_idx"] = order.to(torch.int32)
    if any(c["starts"]):
        args["cache_leftpad"] = torch.tensor(c["starts"], dtype=torch.int32)
    k_cache, v_cache = dense_k.to(c["dtype"]), dense_v.to(c["dtype"])
    if c["page"]:                                   # the rows as shuffled pages, spare NaN pages between
        page = c["page"]
        per_row = c["max_len"] // page
        blocks = rows * per_row + 3
        perm = torch.randperm(blocks, generator=g)[:rows * per_row]
        k_pages = torch.full((blocks, page, hkv, d), float("nan"), dtype=c["dtype"])
        v_pages = k_pages.clone()
        k_pages[perm] = k_cache.reshape(rows * per_row, page, hkv, d)
        v_pages[perm] = v_cache.reshape(rows * per_row, page, hkv, d)
        args["block_table"] = perm.view(rows, per_row).to(torch.int32)
        k_cache, v_cache = k_pages, v_pages
    return q, k_cache, v_cache, k_new if c["n_new"] else None, v_new if c["n_new"] else None, args


def check_case(c, backend):
    q, k_cache, v_cache, k, v, args = build(c)
    truth = attention_with_kvcache_ref(q, k_cache, v_cache, k, v, **args)
    lp = attention_with_kvcache_ref(q, k_cache, v_cache, k, v, **args, upcast=False)
    out, lse = fold.attention_with_kvcache(q, k_cache, v_cache, k, v, **args, return_lse=True, backend=backend)
    check_close("out", out, truth[0], lp[0], c["dtype"])
    check_close("lse", lse, truth[1], lp[1], c["dtype"])
    assert torch.equal(v_cache.nan_to_num(7.0), truth[3].nan_to_num(7.0))          # values written exactly
    if not c["rotate"]:
        assert torch.equal(k_cache.nan_to_num(7.0), truth[2].nan_to_num(7.0))
    else:                                                  # rotated keys: fold's float32 rotation vs float64
        written = ~torch.isnan(truth[2].float())
        assert torch.equal(written, ~torch.isnan(k_cache.float()))
        check_close("written keys", k_cache.float()[written], truth[2].double()[written],
                    truth[2].float()[written], c["dtype"])


@given(case=appends())
def test_torch_append_then_read_matches_the_reference(case):
    check_case(case, "torch")


@INTERPRETED
@given(case=appends())
def test_triton_append_then_read_matches_the_reference(case):
    with use_config(FoldConfig(16, 16, 2, 4, 2)):
        check_case(case, "triton")


def test_the_cache_changes_only_where_the_new_rows_go():
    case = dict(batch=2, n_q=4, heads_kv=2, group=2, head_dim=16, n_new=3, max_len=64, page=0, starts=[5, 0],
                ends=[30, 10], batch_idx=True, rotate=False, window=8, alpha=2.0, causal=False, softcap=None,
                dtype=torch.float32, seed=3)
    q, k_cache, v_cache, k, v, args = build(case)
    before = k_cache.clone()
    fold.attention_with_kvcache(q, k_cache, v_cache, k, v, **args)
    changed = (k_cache.nan_to_num(7.0) != before.nan_to_num(7.0)).any(-1).any(-1)          # [rows, max_len]
    rows = args["cache_batch_idx"].long()
    want = torch.zeros_like(changed)
    want[rows[0], 30:33] = True
    want[rows[1], 10:13] = True
    assert torch.equal(changed, want)


@pytest.mark.parametrize("bad, match", [
    (dict(cache_seqlens=None), "cache_seqlens is required"),
    (dict(cache_seqlens=torch.tensor([1.0, 2.0])), r"cache_seqlens must be a \[batch=2\] int32/int64 tensor"),
    (dict(cache_batch_idx=torch.tensor([0])), r"cache_batch_idx must be a \[batch=2\]"),
    (dict(rotate_new_keys=1), "rotate_new_keys must be"),
    (dict(k=torch.zeros(2, 9, 2, 16), v=torch.zeros(2, 9, 2, 16)), "more than the block's n_q=4"),
    (dict(k=torch.zeros(2, 3, 1, 16)), r"k and v must have shape \[batch, n_new, heads_kv, head_dim\]"),
    (dict(k=torch.zeros(2, 3, 2, 16, dtype=torch.float64), v=torch.zeros(2, 3, 2, 16, dtype=torch.float64)),
     "k and v must have the cache's dtype"),
    (dict(v=None), "k and v are given together"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32), cache_leftpad=torch.tensor([0, 1])),
     "cache_batch_idx and cache_leftpad take a contiguous cache"),
])
def test_bad_input_names_the_argument(bad, match):
    g = torch.Generator().manual_seed(0)
    good = dict(q=torch.randn(2, 4, 4, 16, generator=g), k_cache=torch.randn(2, 64, 2, 16, generator=g),
                v_cache=torch.randn(2, 64, 2, 16, generator=g), k=torch.randn(2, 3, 2, 16, generator=g),
                v=torch.randn(2, 3, 2, 16, generator=g), cache_seqlens=torch.tensor([10, 20]), window=8,
                rope=fold.Rope.from_theta(10000.0, 16))
    with pytest.raises((TypeError, ValueError), match=match):
        fold.attention_with_kvcache(**{**good, **bad})
