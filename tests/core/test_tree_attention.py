"""fold.tree_attention: both backends against the reference; trees from random parent arrays."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fold
from fold.config_lookup import use_config
from fold.kernels.fold_attention import FoldConfig
from reference import tree_attention_ref
from fold.spec_decode.tree import tree_mask  # node i sees its ancestors and itself
from reference.tolerance import check_close
from tests.helpers import INTERPRETED


@st.composite
def tree_cases(draw, dtypes):
    batch = draw(st.integers(1, 2))
    n_tree = draw(st.one_of(st.integers(1, 16), st.integers(1, 64)))   # large trees are slow in the interpreter
    chain = draw(st.booleans())
    masks = []
    for _ in range(batch):
        parents = [i - 1 for i in range(n_tree)] if chain else \
            [draw(st.integers(-1, i - 1)) if i else -1 for i in range(n_tree)]
        masks.append(tree_mask(parents))
    max_len = draw(st.integers(1, 400))
    seqlens = draw(st.one_of(st.none(), st.lists(st.integers(0, max_len), min_size=batch, max_size=batch)))
    return dict(batch=batch, n_tree=n_tree, mask=torch.stack(masks), heads_kv=draw(st.integers(1, 2)),
                group=draw(st.integers(1, 4 if n_tree <= 16 else 2)), head_dim=draw(st.sampled_from([16, 32, 64, 128])), max_len=max_len,
                seqlens=seqlens, dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 999)))


def make(c, pad=float("nan")):
    g = torch.Generator().manual_seed(c["seed"])
    hq = c["heads_kv"] * c["group"]
    q = torch.randn(c["batch"], c["n_tree"], hq, c["head_dim"], generator=g)
    kc = torch.randn(c["batch"], c["max_len"], c["heads_kv"], c["head_dim"], generator=g)
    vc = torch.randn(c["batch"], c["max_len"], c["heads_kv"], c["head_dim"], generator=g)
    kt = torch.randn(c["batch"], c["n_tree"], c["heads_kv"], c["head_dim"], generator=g)
    vt = torch.randn(c["batch"], c["n_tree"], c["heads_kv"], c["head_dim"], generator=g)
    seqlens = None
    if c["seqlens"] is not None:
        seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
        for b, length in enumerate(c["seqlens"]):
            kc[b, length:] = pad
            vc[b, length:] = pad
    return [x.to(c["dtype"]) for x in (q, kc, vc, kt, vt)], seqlens


def check(c, backend):
    (q, kc, vc, kt, vt), seqlens = make(c)
    out, lse = fold.tree_attention(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens, return_lse=True,
                                   backend=backend)
    out64, lse64 = tree_attention_ref(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens)
    out_lp, lse_lp = tree_attention_ref(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens, upcast=False)
    assert out.dtype == c["dtype"] and out.shape == q.shape
    check_close("out", out, out64, out_lp, c["dtype"])
    check_close("lse", lse, lse64, lse_lp, c["dtype"])


configs = st.builds(FoldConfig, block_m=st.sampled_from([16, 64]), block_n=st.sampled_from([16, 64]),
                    num_splits=st.sampled_from([1, 3]), num_warps=st.just(4), num_stages=st.just(2))


@INTERPRETED
@given(c=tree_cases([torch.float32, torch.float16, torch.bfloat16]), config=configs)
def test_triton_matches_reference(c, config):
    with use_config(config):
        check(c, "triton")


@given(c=tree_cases([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_torch_matches_reference(c):
    check(c, "torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_chain_is_causal_attention_over_cache_and_nodes(backend):
    """Chain tree = the nodes appended to the cache under a bottom-right causal mask."""
    c = dict(batch=1, n_tree=5, mask=torch.ones(1, 5, 5, dtype=torch.bool).tril(), heads_kv=2, group=2,
             head_dim=32, max_len=40, seqlens=None, dtype=torch.float32, seed=1)
    (q, kc, vc, kt, vt), _ = make(c)
    out = fold.tree_attention(q, kc, vc, kt, vt, c["mask"], backend=backend)
    k = torch.cat([kc, kt], 1).transpose(1, 2).repeat_interleave(2, 1)
    v = torch.cat([vc, vt], 1).transpose(1, 2).repeat_interleave(2, 1)
    causal = torch.ones(5, 45, dtype=torch.bool).tril(40)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=causal).transpose(1, 2)
    check_close("chain", out, want.double(), want, torch.float32)


@pytest.mark.parametrize("override, error, words", [
    (dict(tree_mask=torch.ones(1, 3, 3)), TypeError, "tree_mask must be a bool tensor"),
    (dict(tree_mask=torch.ones(1, 3, 4, dtype=torch.bool)), ValueError, "tree_mask must have shape"),
    (dict(k_tree=torch.randn(1, 2, 1, 16)), ValueError, "k_tree must have shape"),
    (dict(cache_seqlens=torch.tensor([11])), ValueError, "cache_seqlens must lie in [0, max_len=10]"),
    (dict(v_cache=torch.randn(1, 10, 1, 16, dtype=torch.float64)), TypeError, "v_cache must have q's dtype"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
])
def test_bad_input(override, error, words):
    args = dict(q=torch.randn(1, 3, 2, 16), k_cache=torch.randn(1, 10, 1, 16), v_cache=torch.randn(1, 10, 1, 16),
                k_tree=torch.randn(1, 3, 1, 16), v_tree=torch.randn(1, 3, 1, 16),
                tree_mask=torch.ones(1, 3, 3, dtype=torch.bool))
    args.update(override)
    with pytest.raises(error) as info:
        fold.tree_attention(**args)
    assert words in str(info.value)


@pytest.mark.parametrize("where", ["q", "cache key", "tree value"])
def test_triton_propagates_nan_in_valid_inputs_as_the_reference_does(where):
    """NaN in a node's query, a valid cache key or a node's value reaches the same outputs as in the
    dense reference (a NaN value spreads to every row there too: 0 * NaN)."""
    c = dict(batch=1, n_tree=4, mask=torch.ones(1, 4, 4, dtype=torch.bool).tril(), heads_kv=1, group=2,
             head_dim=16, max_len=40, seqlens=[30], dtype=torch.float32, seed=3)
    (q, kc, vc, kt, vt), seqlens = make(c, pad=0.0)
    if where == "q":
        q[0, 2, 1, 0] = float("nan")
    elif where == "cache key":
        kc[0, 7, 0, 3] = float("nan")
    else:
        vt[0, 2, 0, 3] = float("nan")
    out = fold.tree_attention(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens, backend="triton")
    want, _ = tree_attention_ref(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens)
    assert torch.isnan(out).any() and torch.equal(torch.isnan(out), torch.isnan(want))


@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
def test_triton_reads_a_paged_cache_as_the_contiguous_one(page_size):
    from tests.helpers import to_pages

    c = dict(batch=2, n_tree=5, mask=torch.stack([tree_mask([-1, 0, 0, 1, 2]), tree_mask([-1, 0, 1, 2, 3])]),
             heads_kv=2, group=2, head_dim=32, max_len=150, seqlens=[150, 23], dtype=torch.float32, seed=page_size)
    (q, kc, vc, kt, vt), seqlens = make(c, pad=0.0)
    kp, table = to_pages(kc, seqlens, page_size, torch.Generator().manual_seed(1))
    vp, _ = to_pages(vc, seqlens, page_size, torch.Generator().manual_seed(1))
    with use_config(FoldConfig(16, 16, 3, 4, 2)):
        out, lse = fold.tree_attention(q, kp, vp, kt, vt, c["mask"], cache_seqlens=seqlens, block_table=table,
                                       return_lse=True, backend="triton")
    out64, lse64 = tree_attention_ref(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens)
    out_lp, lse_lp = tree_attention_ref(q, kc, vc, kt, vt, c["mask"], cache_seqlens=seqlens, upcast=False)
    check_close("paged tree out", out, out64, out_lp, torch.float32)
    check_close("paged tree lse", lse, lse64, lse_lp, torch.float32)
