"""fold's vLLM backend with ``"far_budget"``: the per-layer far-page bounds kept beside the paged cache
(updated as the DFlash context precompute writes, at its positions), and the budgeted read over them."""

import pytest
import torch

from fold import far_pages
from fold.vllm.backend import FoldMetadataBuilder, cache_pages
from fold.vllm.config import ServeRead
from tests.helpers import HostReads
from tests.vllm.backend_fixtures import (BLOCKS, D, HKV, PAGE, ROPE, empty_cache, fake_layer, make_batch, make_impl,
                                         slots_of, write_all)

LENGTHS = [37, 60, 4]


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_bounds_kept_on_writes_equal_the_bounds_built_from_the_cache(cache_dtype):
    """The bounds do_kv_cache_update keeps, [num_blocks, Hkv, 2, d] float32 by physical block, equal
    fold.far_pages.page_bounds over the pages as stored (un-rotated, dequantized) on every used block."""
    q, keys, values, cad = make_batch(LENGTHS, 4)
    impl, layer = make_impl(ServeRead("fold", 8, 2.0, far_budget=2 * PAGE), cache_dtype), fake_layer(0.5, 2.0)
    kv_cache = empty_cache(cache_dtype)
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    k_pages, _ = cache_pages(kv_cache, D, impl.cache_dtype)
    want = far_pages.page_bounds(k_pages, PAGE, cache_seqlens=torch.tensor(LENGTHS),
                                 block_table=cad.block_table_tensor, k_scale=impl.scales(layer)[0])
    used = torch.cat([cad.block_table_tensor[b, :-(-n // PAGE)] for b, n in enumerate(LENGTHS)]).long()
    got = impl.far_bounds
    assert got.shape == (BLOCKS, HKV, 2, D) and got.dtype == torch.float32
    assert torch.equal(got[used], want[used])       # the keys as the cache holds them, entry by entry
    unused = torch.ones(BLOCKS, dtype=torch.bool)
    unused[used] = False
    assert (got[unused][:, :, 0] == float("-inf")).all() and (got[unused][:, :, 1] == float("inf")).all()


def test_the_drafting_forward_leaves_the_bounds_alone():
    """The block's rows (written by the drafting forward) are not folded in: never far in the round that
    writes them, and the precompute rewrites each committed one."""
    q, keys, values, cad = make_batch(LENGTHS, 4)
    impl, layer = make_impl(ServeRead("fold", 8, 2.0, far_budget=2 * PAGE)), fake_layer()
    kv_cache = empty_cache("auto")
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    before = impl.far_bounds.clone()
    cad.slot_mapping = torch.cat([slots_of(cad.block_table_tensor[b:b + 1], [n])[-4:] for b, n in enumerate(LENGTHS)])
    meta = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu")).build(0, cad)
    impl.forward(layer, q, torch.randn(len(q), HKV, D) * 100, torch.randn(len(q), HKV, D), kv_cache, meta,
                 torch.empty_like(q))
    assert torch.equal(impl.far_bounds, before)


def _forward(read, sliding=None):
    q, keys, values, cad = make_batch(LENGTHS, 4)
    impl, layer = make_impl(read, sliding=sliding, causal=sliding is not None), fake_layer()
    kv_cache = empty_cache("auto")
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    meta = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu")).build(0, cad)
    output = torch.full_like(q, float("nan"))
    impl.forward(layer, q, None, None, kv_cache, meta, output)
    return output, impl, q, kv_cache, cad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sliding", [None, 20])
def test_a_budget_covering_every_page_reads_as_fold(backend, sliding):
    full, *_ = _forward(ServeRead("fold", 8, 2.0, backend=backend), sliding)
    covered, *_ = _forward(ServeRead("fold", 8, 2.0, backend=backend, far_budget=BLOCKS * PAGE), sliding)
    assert torch.isfinite(covered).all()
    torch.testing.assert_close(covered, full, rtol=0, atol=0)


@pytest.mark.parametrize("backend,rank", [("torch", "bound"), ("triton", "bound"), ("torch", "keys"),
                                          ("triton", "keys")])
def test_the_budgeted_read_is_fold_attention_over_the_kept_bounds(backend, rank):
    """forward() with a 2-page budget is fold.attention(far_budget=, far_page=block size, far_bounds=)
    over the pages, the block table and the bounds built from scratch."""
    import fold

    read = ServeRead("fold", 8, 2.0, backend=backend, far_budget=2 * PAGE, far_rank=rank)
    output, impl, q, kv_cache, cad = _forward(read)
    k_pages, v_pages = cache_pages(kv_cache, D)
    bounds = far_pages.page_bounds(k_pages, PAGE, cache_seqlens=torch.tensor(LENGTHS),
                                   block_table=cad.block_table_tensor)
    want = fold.attention(q.view(3, 4, *q.shape[1:]), k_pages, v_pages, window=8, rope=ROPE, alpha=2.0,
                          cache_seqlens=cad.seq_lens, block_table=cad.block_table_tensor, keys_rotated=False,
                          queries_rotated=True, softmax_scale=D ** -0.5, far_budget=2 * PAGE, far_page=PAGE,
                          far_bounds=bounds, far_rank=rank, backend=backend)
    assert torch.equal(output, want.flatten(0, 1))  # the same op on the same pages and bounds


def test_a_budgeted_drafting_step_reads_nothing_on_the_host():
    """Page writes, bounds update and forward with the kernels' path: no host read (V2's graphs)."""
    q, keys, values, cad = make_batch([37, 50], 4)
    impl, layer = make_impl(ServeRead("fold", 8, 2.0, backend="triton", far_budget=2 * PAGE)), fake_layer()
    kv_cache = empty_cache("auto")
    write_all(impl, layer, kv_cache, keys, values, cad.block_table_tensor)
    cad.slot_mapping = slots_of(cad.block_table_tensor, [37, 50])[[33, 34, 35, 36, 83, 84, 85, 86]]
    output = torch.zeros_like(q)
    with HostReads() as reads:
        impl.context_positions = torch.arange(8)                    # the precompute's path too
        meta = FoldMetadataBuilder(None, ["layer"], None, torch.device("cpu")).build(0, cad)
        impl.do_kv_cache_update(layer, torch.randn(8, HKV, D), torch.randn(8, HKV, D), kv_cache, meta.slot_mapping)
        impl.context_positions = None
        impl.forward(layer, q, None, None, kv_cache, meta, output)
    assert reads.calls == [] and torch.isfinite(output).all()


def test_far_page_other_than_the_block_size_is_refused():
    with pytest.raises(ValueError, match="fold.far_page must equal the drafter cache's block size 16"):
        _forward(ServeRead("fold", 8, 2.0, far_budget=64, far_page=32))


# -- in the engine ---------------------------------------------------------------------------------------

def _keep_with_bounds(impl, args, kwargs, output):
    from tests.vllm.engine import keep_attention

    call = keep_attention(impl, args, kwargs, output)
    if call is not None:
        call["bounds"] = None if impl.far_bounds is None else impl.far_bounds.clone()
    return call


def _run_with_bounds(llm, prompts, max_tokens):
    from fold.vllm.backend import FoldAttentionImpl
    from tests.vllm.engine import DFlashProposer, Recorder, generate

    with Recorder(FoldAttentionImpl, "forward", _keep_with_bounds) as rec, \
            Recorder(DFlashProposer, "propose", lambda obj, a, kw, r: r.clone()) as drafts:
        out = generate(llm, prompts, max_tokens)
    return out, [c for c in rec.calls if c is not None], drafts.calls


@pytest.fixture(scope="module")
def budgeted(pairs):
    """The engine with a fold drafter whose far read is budgeted to 2 pages of 32 (the cache's blocks),
    and with a budget past max_model_len (every page read)."""
    from tests.vllm.engine import MAX_TOKENS, PROMPTS, SMALL_W, configured, served

    runs = {}
    for name, budget in (("budget", 64), ("keys", 64), ("covering", 4096), ("fold", None)):
        rank = {"far_rank": "keys"} if name == "keys" else {}
        drafter = configured(pairs, f"drafter-{name}", read="fold", window=SMALL_W, alpha=2.0, far_budget=budget,
                             **rank)
        runs[name] = served(lambda llm: _run_with_bounds(llm, PROMPTS, MAX_TOKENS), pairs["plain"], drafter)
    return runs


@pytest.mark.parametrize("run", ["budget", "keys"])
def test_a_budgeted_drafter_is_lossless_in_the_engine(budgeted, target_greedy, run):
    from tests.vllm.engine import K, SMALL_W, drafting

    out, calls, _ = budgeted[run]
    assert out == target_greedy[0]
    calls = drafting(calls)
    # the budget bites: far memory (entries far for row 0) beyond the 2 pages read
    assert any(n - 2 * (K + 1) - SMALL_W > 64 for c in calls for n in c["seq_lens"])


def test_a_covering_budget_drafts_what_fold_drafts_in_the_engine(budgeted):
    out, _, drafts = budgeted["covering"]
    fold_out, _, fold_drafts = budgeted["fold"]
    assert out == fold_out and len(drafts) == len(fold_drafts)
    assert all(torch.equal(a, b) for a, b in zip(drafts, fold_drafts))


def test_the_engines_kept_bounds_bound_every_far_page_and_the_read_follows_them(budgeted):
    """On every drafting call the kept bounds (by physical block) hold each fully far page's un-rotated
    keys (exact or looser), and the engine's output is the reference's budgeted read over those bounds."""
    from reference import fold_attention_ref
    from reference.tolerance import check_close
    from tests.vllm.engine import drafting

    _, calls, _ = budgeted["budget"]
    calls = drafting(calls)
    assert calls and all(c["bounds"] is not None for c in calls)
    for i, call in enumerate(calls):
        read, n_q, page = call["read"], call["n_q"], 32
        k = torch.nan_to_num(call["k"])
        exact = far_pages.page_bounds(k, page, cache_seqlens=torch.tensor(call["seq_lens"]))
        kept = torch.stack([far_pages.empty_bounds(exact.shape[1], *exact.shape[2:3], exact.shape[-1])
                            for _ in call["seq_lens"]])
        for b, (length, table) in enumerate(zip(call["seq_lens"], call["tables"])):
            kept[b, :len(table)] = call["bounds"][torch.tensor(table)]
            far_pages_full = max(0, (length - n_q - (read.window + n_q) + 1) // page)   # fully far for every row
            got, want = kept[b, :far_pages_full], exact[b, :far_pages_full]
            assert (got[..., 0, :] >= want[..., 0, :] - 1e-5).all() and (got[..., 1, :] <= want[..., 1, :] + 1e-5).all()
        q = call["q"].view(-1, n_q, *call["q"].shape[1:])
        kw = dict(window=read.window, rope=call["rope"], alpha=read.alpha, cache_seqlens=call["seq_lens"],
                  keys_rotated=False, queries_rotated=True, softmax_scale=call["scale"], far_budget=read.far_budget,
                  far_page=page, far_bounds=kept)
        truth = [fold_attention_ref(q, k, torch.nan_to_num(call["v"]), **kw, upcast=u)[0].flatten(0, 1)
                 for u in (True, False)]
        check_close(f"call {i}", call["out"], truth[0], truth[1], torch.float32)
