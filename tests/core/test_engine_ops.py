"""Engine-facing behaviour of both ops: paged KV caches (flash-attn's block_table convention),
torch.compile through the custom ops, and range checks that cost no host sync unless asked for."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fold
from fold.spec_decode.tree import tree_mask
from reference import tree_attention_ref
from tests.helpers import Case, HostReads, assert_close, kwargs_of, make_inputs, reference_pair, to_pages

PAGED_BACKENDS = ["torch", "triton"]


@st.composite
def paged_cases(draw):
    batch = draw(st.integers(1, 3))
    n_q = draw(st.sampled_from([1, 4, 7]))
    max_len = draw(st.integers(n_q, 400))
    seqlens = tuple(draw(st.lists(st.integers(n_q, max_len), min_size=batch, max_size=batch)))
    head_dim = draw(st.sampled_from([16, 32]))
    case = Case(batch=batch, n_q=n_q, heads_kv=draw(st.integers(1, 2)), group=draw(st.integers(1, 3)),
                head_dim=head_dim, rotary_dim=draw(st.sampled_from([head_dim, head_dim // 2])),
                interleaved=draw(st.booleans()), max_len=max_len, seqlens=seqlens,
                window=draw(st.integers(0, 64)), alpha=draw(st.floats(1.0, 4.0)), keys_rotated=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 999)))
    return case, draw(st.sampled_from([1, 3, 16, 64])), draw(st.sampled_from(PAGED_BACKENDS))


@settings(max_examples=40)
@given(args=paged_cases())
def test_paged_cache_reads_exactly_what_the_contiguous_cache_reads(args):
    case, page_size, backend = args
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    g = torch.Generator().manual_seed(case.seed)
    k_pages, table = to_pages(k, seqlens, page_size, g)
    v_pages, table_v = to_pages(v, seqlens, page_size, torch.Generator().manual_seed(case.seed))
    assert torch.equal(table, table_v)
    got, got_lse = fold.attention(q, k_pages, v_pages, **kwargs_of(case, seqlens), block_table=table, return_lse=True,
                                  backend=backend)
    (out64, lse64), (out_lp, lse_lp) = reference_pair(case, q, k, v, seqlens)
    assert_close("paged out", got, out64, out_lp, case.dtype)
    assert_close("paged lse", got_lse, lse64, lse_lp, case.dtype)


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_tree_attention(backend, page_size):
    g = torch.Generator().manual_seed(page_size)
    q = torch.randn(2, 5, 4, 16, generator=g)
    kc, vc = torch.randn(2, 70, 2, 16, generator=g), torch.randn(2, 70, 2, 16, generator=g)
    kt, vt = torch.randn(2, 5, 2, 16, generator=g), torch.randn(2, 5, 2, 16, generator=g)
    mask = torch.stack([tree_mask([-1, 0, 0, 1, 2]), tree_mask([-1, 0, 1, 2, 3])])
    seqlens = torch.tensor([70, 23], dtype=torch.int32)
    kp, table = to_pages(kc, seqlens, page_size, torch.Generator().manual_seed(1))
    vp, _ = to_pages(vc, seqlens, page_size, torch.Generator().manual_seed(1))
    got = fold.tree_attention(q, kp, vp, kt, vt, mask, cache_seqlens=seqlens, block_table=table, backend=backend)
    truth, _ = tree_attention_ref(q, kc, vc, kt, vt, mask, cache_seqlens=seqlens)
    same_dtype, _ = tree_attention_ref(q, kc, vc, kt, vt, mask, cache_seqlens=seqlens, upcast=False)
    assert_close("paged tree out", got, truth, same_dtype, torch.float32)


CASE = Case(batch=2, n_q=4, heads_kv=2, group=2, head_dim=16, rotary_dim=16, max_len=48, seqlens=(48, 20), window=8)


def _paged_args(page_size=16):
    q, k, v, seqlens = make_inputs(CASE, pad=0.0)
    kp, table = to_pages(k, seqlens, page_size, torch.Generator().manual_seed(0))
    vp, _ = to_pages(v, seqlens, page_size, torch.Generator().manual_seed(0))
    return q, kp, vp, seqlens, table


@pytest.mark.parametrize("override, error, words", [
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "block_table must have shape [batch=2"),
    (dict(block_table="pages"), TypeError, "block_table must be a [batch, max_blocks] int32 tensor"),
    (dict(cache_seqlens=None), ValueError, "cache_seqlens is required with block_table"),
    (dict(cache_seqlens=torch.tensor([49, 20])), ValueError, "(the 3 pages of 16 entries block_table holds)"),
    (dict(table_entry=99), ValueError, "block_table entries of the pages in use must lie in [0, num_blocks=9)"),
    (dict(check_ranges="yes"), TypeError, "check_ranges must be None, True or False"),
])
def test_bad_paged_input_names_the_argument(override, error, words):
    q, kp, vp, seqlens, table = _paged_args()
    if "table_entry" in override:
        table = table.clone()
        table[1, 0] = override.pop("table_entry")
    args = {**dict(block_table=table, cache_seqlens=seqlens), **override}
    with pytest.raises(error) as info:
        fold.attention(q, kp, vp, window=8, rope=fold.Rope.from_theta(10000.0, 16), **args)
    assert words in str(info.value)


def test_unused_table_entries_are_never_checked_or_read():
    q, kp, vp, seqlens, table = _paged_args()
    assert table[1, 2] == -7                          # sequence 1 holds 20 entries: its third page is unused
    fold.attention(q, kp, vp, window=8, rope=fold.Rope.from_theta(10000.0, 16), cache_seqlens=seqlens,
                   block_table=table, check_ranges=True)


def test_check_ranges_false_skips_value_checks_only():
    q, k, v, _ = make_inputs(CASE, pad=0.0)
    rope = fold.Rope.from_theta(10000.0, 16)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        fold.attention(q, k, v, window=8, rope=rope, cache_seqlens=torch.tensor([48, 2]))
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \[batch=2\]"):   # shapes: always
        fold.attention(q, k, v, window=8, rope=rope, cache_seqlens=torch.tensor([48]), check_ranges=False)


@pytest.mark.parametrize("keys_rotated", [False, True])
def test_compiled_attention_traces_through_without_graph_breaks(keys_rotated):
    case = CASE.with_(keys_rotated=keys_rotated)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    kw = kwargs_of(case, seqlens)

    def f(q, k, v, seqlens):
        out, lse = fold.attention(q, k, v, window=kw["window"], rope=kw["rope"], alpha=kw["alpha"],
                                  cache_seqlens=seqlens, keys_rotated=keys_rotated, return_lse=True, backend="torch")
        return out * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, got_lse = compiled(q, k, v, seqlens)
    want, want_lse = f(q, k, v, seqlens)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    q2, k2, v2, _ = make_inputs(case.with_(seed=5), pad=0.0)
    seqlens2 = torch.tensor([30, 41], dtype=torch.int32)                  # new values, same graph
    assert torch.equal(compiled(q2, k2, v2, seqlens2)[0], f(q2, k2, v2, seqlens2)[0])


def test_compiled_tree_attention_and_paged_read():
    q, kp, vp, seqlens, table = _paged_args()
    rope = fold.Rope.from_theta(10000.0, 16)
    kt, vt = kp[0, :3].unsqueeze(0).expand(2, 3, 2, 16), vp[0, :3].unsqueeze(0).expand(2, 3, 2, 16)
    mask = tree_mask([-1, 0, 0])[None].expand(2, 3, 3)

    def f(q, kp, vp, seqlens, table):
        a = fold.attention(q, kp, vp, window=8, rope=rope, cache_seqlens=seqlens, block_table=table, backend="torch")
        b = fold.tree_attention(q[:, :3], kp, vp, kt, vt, mask, cache_seqlens=seqlens, block_table=table,
                                backend="torch")
        return a, b

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kp, vp, seqlens, table)
    want = f(q, kp, vp, seqlens, table)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_the_ops_are_registered_custom_ops():
    import fold.ops  # noqa: F401  (registered on import; fold.fold_attention imports it at its first call)

    assert hasattr(torch.ops.fold, "attention") and hasattr(torch.ops.fold, "tree_attention")
    q, k, v, seqlens = make_inputs(CASE, pad=0.0)
    torch.library.opcheck(torch.ops.fold.attention.default,
                          (q, k, v, fold.Rope.from_theta(10000.0, 16).inv_freq, seqlens.int(), None, 8, 2.0, 0.25, 16,
                           False, 1.0, False, True, False, "torch", True, -1, False, 1.0, 1.0))


def test_a_paged_read_is_configured_for_the_tables_reach(monkeypatch):
    """The split model must see the cache's length (pages x page size), not the page size."""
    from fold import config_lookup

    seen = []
    real = config_lookup.shape_key                 # the length config_for keys the config (and its splits) on
    monkeypatch.setattr(config_lookup, "shape_key", lambda **kw: (seen.append(kw["max_len"]), real(**kw))[1])
    q, kp, vp, seqlens, table = _paged_args()
    fold.attention(q, kp, vp, window=8, rope=fold.Rope.from_theta(10000.0, 16), cache_seqlens=seqlens,
                   block_table=table, backend="triton")
    kt, vt = kp[0, :3].unsqueeze(0).expand(2, 3, 2, 16), vp[0, :3].unsqueeze(0).expand(2, 3, 2, 16)
    fold.tree_attention(q[:, :3], kp, vp, kt, vt, tree_mask([-1, 0, 0])[None].expand(2, 3, 3), cache_seqlens=seqlens,
                        block_table=table, backend="triton")
    assert seen == [table.shape[1] * kp.shape[1]] * 2


@pytest.mark.parametrize("options", [dict(), dict(far_position="none"), dict(sliding_window=12, causal=True),
                                     dict(fp8=True, k_scale=0.5, v_scale=2.0), dict(queries_rotated=True,
                                                                                  keys_rotated=True)],
                         ids=["fold", "window", "sliding", "fp8", "engine-layout"])
def test_the_triton_path_reads_no_tensor_on_the_host(options):
    """What a CUDA graph needs of a read: with range checks off (as engines call it), neither the
    launchers nor the validation read a tensor on the host (the torch path, a CPU's, may); the control
    shows the detector sees such reads."""
    options = dict(options)
    q, kp, vp, seqlens, table = _paged_args()
    if options.pop("fp8", False):
        kp, vp = kp.to(torch.float8_e4m3fn), vp.to(torch.float8_e4m3fn)
    kw = dict(window=8, rope=fold.Rope.from_theta(10000.0, 16), cache_seqlens=seqlens, block_table=table,
              check_ranges=False, **options)
    with HostReads() as reads:
        out = fold.attention(q, kp, vp, **kw, backend="triton")
        kt, vt = kp[0, :3].unsqueeze(0).expand(2, 3, 2, 16), vp[0, :3].unsqueeze(0).expand(2, 3, 2, 16)
        if kp.dtype == q.dtype:
            fold.tree_attention(q[:, :3], kp, vp, kt, vt, tree_mask([-1, 0, 0])[None].expand(2, 3, 3),
                                cache_seqlens=seqlens, block_table=table, check_ranges=False, backend="triton")
    assert reads.calls == [] and torch.isfinite(out).all()
    with HostReads() as control:
        fold.attention(q, kp, vp, **kw, backend="torch")
    assert ("tolist", "fold.torch_path") in control.calls
