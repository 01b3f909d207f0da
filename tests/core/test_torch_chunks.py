"""The torch path's chunked reads merged in groups: with 64-entry chunks and three states kept before
a merge, every rotated, gathered or budgeted segment is many chunks merged group by group."""

import pytest
import torch

import fold
import fold.torch_path as torch_backend
from reference import fold_attention_ref
from tests.helpers import Case, assert_close, check_against_reference, kwargs_of, make_inputs, to_pages



@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 1)
    monkeypatch.setattr(torch_backend, "MERGE_STATES", 3)


@pytest.mark.parametrize("keys_rotated", [False, True])
def test_grouped_merges_match_the_reference(small_chunks, keys_rotated):
    check_against_reference(Case(batch=2, n_q=7, heads_kv=2, group=3, max_len=1500, seqlens=(1500, 700), window=40,
                                 keys_rotated=keys_rotated, attention_factor=1.25), backend="torch")


def test_grouped_merges_of_gathered_pages_and_budgets(small_chunks):
    case = Case(batch=2, n_q=4, heads_kv=2, group=2, max_len=1200, seqlens=(1200, 500), window=24, keys_rotated=True)
    q, k, v, seqlens = make_inputs(case, pad=0.0)
    kw = kwargs_of(case, seqlens)
    (kp, table), (vp, _) = (to_pages(x, seqlens, 16, torch.Generator().manual_seed(4)) for x in (k, v))
    for budget in (None, 640):
        ref = dict(far_budget=budget, far_page=16) if budget else {}
        truth = fold_attention_ref(q, k, v, **kw, **ref)
        twin = fold_attention_ref(q, k, v, **kw, **ref, upcast=False)
        out = fold.attention(q, kp, vp, **kw, block_table=table, **ref, backend="torch")
        assert_close(f"paged, far_budget={budget}", out, truth[0], twin[0], case.dtype)


def test_a_read_leaves_the_thread_count_as_it_found_it():
    """The torch path runs its small ops on one thread and its fused reads on the caller's: afterwards
    (and after a failing read) torch's intra-op thread count is the caller's again."""
    case = Case(batch=2, n_q=4, group=2, max_len=300, seqlens=(300, 50), window=16, keys_rotated=True)
    q, k, v, seqlens = make_inputs(case)
    before = torch.get_num_threads()
    seen = []
    real = torch_backend._fused_read

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    mp = pytest.MonkeyPatch()
    mp.setattr(torch_backend, "_fused_read", spy)
    try:
        fold.attention(q, k, v, **kwargs_of(case, seqlens), backend="torch")
    finally:
        mp.undo()
    assert torch.get_num_threads() == before and seen and set(seen) == {1}      # around the reads: serial

    def boom(*args):
        raise RuntimeError("boom")

    mp.setattr(torch_backend, "_fused_read", boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            fold.attention(q, k, v, **kwargs_of(case, seqlens), backend="torch")
    finally:
        mp.undo()
    assert torch.get_num_threads() == before


def test_a_budgeted_selection_runs_serially():
    """On a CPU the far-page selection runs on one thread (as a read's small ops), the keys rank's
    per-step conversions and products included; afterwards the count is the caller's again."""
    from fold import far_pages

    case = Case(batch=1, n_q=4, group=2, max_len=600, window=16)
    q, k, v, _ = make_inputs(case)
    bounds = far_pages.page_bounds(k, 16)                    # kept bounds: _keys_for_bounds below is the ranking's
    before = torch.get_num_threads()
    seen = {"far_queries": [], "_keys_for_bounds": []}
    mp = pytest.MonkeyPatch()
    for name in seen:
        real = getattr(far_pages, name)

        def spy(*args, _real=real, _name=name, **kw):
            seen[_name].append(torch.get_num_threads())
            return _real(*args, **kw)
        mp.setattr(far_pages, name, spy)
    torch.set_num_threads(2)
    try:
        fold.attention(q, k, v, **kwargs_of(case, None), far_budget=64, far_page=16, far_bounds=bounds,
                       far_rank="keys", backend="torch")
        assert torch.get_num_threads() == 2
    finally:
        mp.undo()
        torch.set_num_threads(before)
    assert seen["far_queries"] == [1] and seen["_keys_for_bounds"] and set(seen["_keys_for_bounds"]) == {1}
