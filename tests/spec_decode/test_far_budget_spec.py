"""``spec_decode.generate(..., policy="fold", far_budget=N, far_page=P)``: the drafter reads at most N far
entries per round, chosen by per-page key bounds its cache keeps as it grows; the loop stays lossless,
and with a budget covering the whole far memory the drafts are FOLD's own."""

import pytest
import torch

import fold
from fold import spec_decode
from fold.spec_decode.policies import PageBounds
from tests.spec_decode_fixtures import greedy_ar, make_drafter, make_target, padded_batch

far_pages = pytest.importorskip("fold.far_pages")     # the core's module (issue 31)

HKV, D, P = 2, 16, 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target("llama", tmp_path_factory.mktemp("target"))
    drafter = spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp("zlab"), target, "zlab"), target)
    return target, drafter


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g) for n in lengths]


def _recording(drafter):
    """Wrap ``drafter.draft`` to keep every round's drafted tokens; returns the list."""
    drafts, draft = [], drafter.draft

    def recorded(*args, **kwargs):
        tokens, probs = draft(*args, **kwargs)
        drafts.append(list(tokens))
        return tokens, probs
    drafter.draft = recorded
    return drafts


@pytest.mark.parametrize("rank", ["bound", "keys"])
def test_lossless_with_a_budget_batch_one(pair, rank):
    """Window 8, pages of 4, a budget of 4 pages (2 for the pages the block straddles, 2 chosen by their
    bounds or keys) over a far memory of up to 17 pages: the output is the target's own greedy output."""
    target, drafter = pair
    (ids,) = _prompts([56])
    result = spec_decode.generate(target, drafter, ids[None], max_new_tokens=24, window=8, far_budget=16, far_page=P,
                           far_rank=rank)
    assert torch.equal(result.sequences[0], greedy_ar(target, ids, 24))


@pytest.mark.parametrize("rank", ["bound", "keys"])
def test_lossless_with_a_budget_batch_three_left_padded(pair, rank):
    target, drafter = pair
    prompts = _prompts([40, 17, 53], seed=1)
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, window=8, far_budget=16,
                           far_page=P, far_rank=rank)
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 20)
        assert torch.equal(result.sequences[b, :len(want)], want)


def test_a_budget_covering_the_far_memory_drafts_what_fold_drafts(pair):
    """far_budget >= every far entry: every page is read, so each round's drafts (and acceptances) equal
    policy="fold" without a budget."""
    target, drafter = pair
    (ids,) = _prompts([45], seed=3)
    runs = []
    for budget in (None, 1024):
        drafts = _recording(drafter)
        try:
            result = spec_decode.generate(target, drafter, ids[None], max_new_tokens=16, window=8, far_budget=budget,
                                   far_page=P)
        finally:
            del drafter.draft
        runs.append((drafts, result.stats["per_sequence"][0]["accepted_per_round"], result.sequences))
    (full_drafts, full_acc, full_seq), (budget_drafts, budget_acc, budget_seq) = runs
    assert budget_drafts == full_drafts and budget_acc == full_acc and torch.equal(budget_seq, full_seq)


def _keys(length, seed=0):
    return torch.randn(1, length, HKV, D, generator=torch.Generator().manual_seed(seed))


def test_page_bounds_grow_incrementally_to_the_exact_bounds():
    """Entries folded in chunk by chunk as the cache grows give the bounds built from scratch over the
    committed entries; the block's rows after them are never folded in."""
    k = _keys(37)
    bounds = PageBounds(P)
    for n in (5, 8, 9, 21, 33):                       # committed entries at each read; 4 block rows after them
        got = bounds.bounds(0, k[:, :n + 4], n)
        want = far_pages.page_bounds(k[:, :n + 4], P, cache_seqlens=torch.tensor([n]))
        assert got.shape == want.shape == (1, -(-(n + 4) // P), HKV, 2, D)
        assert torch.equal(got, want)
    assert bounds.count[0] == 33


def test_a_truncated_cache_keeps_bounds_that_still_bound():
    """A cut back to 13 entries: pages past it are empty, the cut page's box still holds what remains
    (looser is allowed), and appending again from there keeps every page a bound of its entries."""
    k = _keys(40, seed=1)
    bounds = PageBounds(P)
    bounds.bounds(0, k[:, :30], 30)
    cut = bounds.bounds(0, k[:, :17], 13)             # the cache is seen shorter: a truncation
    assert torch.isinf(cut[0, 4:]).all() and (cut[0, 4:, :, 0] < 0).all()
    exact = far_pages.page_bounds(k[:, :17], P, cache_seqlens=torch.tensor([13]))
    assert (cut[0, :4, :, 0] >= exact[0, :4, :, 0]).all() and (cut[0, :4, :, 1] <= exact[0, :4, :, 1]).all()
    assert torch.equal(cut[0, :3], exact[0, :3])      # pages wholly before the cut are untouched
    fresh = _keys(40, seed=2)                          # entries 13.. rewritten with other keys
    k2 = torch.cat([k[:, :13], fresh[:, 13:]], 1)
    again = bounds.bounds(0, k2[:, :36], 32)
    exact = far_pages.page_bounds(k2[:, :36], P, cache_seqlens=torch.tensor([32]))
    assert (again[..., 0, :] >= exact[..., 0, :]).all() and (again[..., 1, :] <= exact[..., 1, :]).all()
    assert torch.equal(again[0, 4:8], exact[0, 4:8])  # pages rewritten from offset 0 start fresh boxes


@pytest.mark.parametrize("rank", ["bound", "keys"])
def test_the_budgeted_read_is_fold_attention_with_the_kept_bounds(rank):
    """FoldRead passes far_budget, far_page, far_rank and the kept bounds to fold.attention: its output is
    the op's with bounds built from scratch."""
    from fold.spec_decode.policies import make_read

    rope = fold.Rope.from_theta(1e4, D)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 4, D, generator=g)
    k, v = torch.randn(1, 44, HKV, D, generator=g), torch.randn(1, 44, HKV, D, generator=g)
    read = make_read("fold", rope, request=dict(prompt_len=40, max_new_tokens=4, block_size=4), window=8,
                     far_budget=16, far_page=P, far_rank=rank)
    bounds = far_pages.page_bounds(k, P, cache_seqlens=torch.tensor([40]))
    want = fold.attention(q, k, v, window=8, rope=rope, alpha=2.0, far_budget=16, far_page=P, far_bounds=bounds,
                          far_rank=rank)
    assert torch.equal(read(q, k, v, 0), want)
    assert not torch.equal(want, fold.attention(q, k, v, window=8, rope=rope, alpha=2.0))   # pages were left out


@pytest.fixture(scope="module")
def swa_drafter(pair, tmp_path_factory):
    target, _ = pair
    return spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp("zlab-swa"), target, "zlab-swa"), target)


@pytest.mark.parametrize("batch", [1, 2])
def test_lossless_with_a_budget_on_a_drafter_with_sliding_layers(pair, swa_drafter, batch):
    """A sliding-window layer's far read is budgeted too (same kept bounds): still lossless."""
    target, _ = pair
    prompts = _prompts([50, 33][:batch], seed=5)
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, swa_drafter, ids, attention_mask=mask, max_new_tokens=16, window=8,
                           far_budget=16, far_page=P)
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 16)
        assert torch.equal(result.sequences[b, :len(want)], want)


@pytest.mark.parametrize("causal", [True, False])
def test_the_sliding_read_is_budgeted_with_the_layers_bounds(causal):
    """read.sliding with a budget is fold.attention(sliding_window=, far_budget=, far_bounds=) over bounds
    built from scratch; with a budget covering the far memory it is the unbudgeted sliding read."""
    from fold.spec_decode.policies import fold_sliding_read, make_read

    rope = fold.Rope.from_theta(1e4, D)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 4, D, generator=g)
    k, v = torch.randn(1, 44, HKV, D, generator=g), torch.randn(1, 44, HKV, D, generator=g)
    request = dict(prompt_len=40, max_new_tokens=4, block_size=4)
    read = make_read("fold", rope, request=request, window=8, far_budget=16, far_page=P)
    bounds = far_pages.page_bounds(k, P, cache_seqlens=torch.tensor([40]))
    want = fold.attention(q, k, v, window=8, rope=rope, alpha=2.0, sliding_window=6, causal=causal, far_budget=16,
                          far_page=P, far_bounds=bounds)
    assert torch.equal(read.sliding(q, k, v, 0, sliding_window=6, causal=causal), want)
    full = fold_sliding_read(q, k, v, rope=rope, sliding_window=6, causal=causal, window=8, alpha=2.0)
    assert not torch.equal(want, full)                                                      # pages were left out
    covered = make_read("fold", rope, request=request, window=8, far_budget=64, far_page=P)
    assert torch.equal(covered.sliding(q, k, v, 0, sliding_window=6, causal=causal), full)
