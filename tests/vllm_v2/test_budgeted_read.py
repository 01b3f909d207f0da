"""A budgeted far read (``far_budget``) through vLLM 0.34's V2 ``DFlashSpeculator`` (CPU).

The drafter reads ``"fold"`` with a window of :data:`WINDOW` and ``far_budget`` :data:`BUDGET` =
2 pages of ``far_page`` 16, the cache's block size: the far branch of each request and KV head reads
the pages the block's rows straddle and the best-bounded rest, up to 2 pages. The bounds are kept per
physical block beside the cache (``FoldAttentionImpl.far_bounds``), folded in as V2's context K/V
precompute writes the committed entries, at the positions
:func:`fold.vllm.models.hand_context_positions` hands the layers around that call. The contexts of
:data:`SCHEDULE` (45 to 101 entries) hold far memory of many more pages than the budget. Checked as
``tests/vllm/test_far_budget.py`` checks the V1 engine's: the kept bounds against the cache read back,
and every call against ``reference.fold_attention_ref`` with the same budget over those bounds.
"""

import inspect

import pytest
import torch

from fold import far_pages
from fold.vllm.backend import FoldAttentionImpl
from reference import fold_attention_ref
from reference.tolerance import check_close
from tests.vllm.pair import TAPS
from tests.vllm_v2.harness import (BLOCK, FORWARD, K, Recorder, Speculator, Target, keep_attention, recorded_rounds,
                                   with_block)

WINDOW = 4
BUDGET = 2 * BLOCK               # the least a block of K + 1 = 4 rows allows: the pages it straddles
N_Q = K + 1
PROMPTS = {0: [3 + (11 * i) % 240 for i in range(70)], 1: list(range(5, 50)),
           2: [4 + (13 * i) % 230 for i in range(90)]}
SCHEDULE = [
    [(0, PROMPTS[0]), (1, PROMPTS[1])],
    [(0, 0), (1, 2)],
    [(0, K), (1, 1), (2, PROMPTS[2])],
    [(0, 2), (1, 0), (2, K)],
]


def keep_with_bounds(impl, args, kwargs, output):
    """:func:`keep_attention` and the layer's far-page bounds as they stood, with each request's pages."""
    call = keep_attention(impl, args, kwargs, output)
    if not call["dummy"]:
        meta = FORWARD.bind(impl, *args, **kwargs).arguments["attn_metadata"]
        call["bounds"] = None if impl.far_bounds is None else impl.far_bounds.clone()
        call["tables"] = [meta.block_table[b, :-(-n // BLOCK)].tolist() for b, n in enumerate(call["seq_lens"])]
    return call


WRITE = inspect.signature(FoldAttentionImpl.write)


def keep_write(impl, args, kwargs, result):
    """One cache write (``FoldAttentionImpl.write``): the layer, its slots and positions, and whether it came
    from the context precompute (which keeps the far-page bounds) or the drafting forward."""
    bound = WRITE.bind(impl, *args, **kwargs).arguments
    return dict(impl=impl, slots=bound["slot_mapping"].clone(), positions=bound["positions"].clone(),
                precompute=bound.get("bounds", False))


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    return v2_process.make_pair(tmp_path_factory.mktemp("v2-budget"))


@pytest.fixture(scope="module", params=["bound", "keys"])
def budget_run(request, pair, target):
    drafter = with_block(pair, f"drafter-budget-{request.param}", read="fold", window=WINDOW, alpha=2.0,
                         far_budget=BUDGET, far_page=BLOCK, far_rank=request.param)
    speculator = Speculator(pair["target"], drafter)
    with Recorder(FoldAttentionImpl, "write", keep_write) as writes:
        run = recorded_rounds(speculator, target, SCHEDULE, keep=keep_with_bounds)
    return dict(run, writes=writes.calls, rank=request.param)


@pytest.fixture(scope="module")
def target(pair):
    return Target(pair["target"], TAPS)


def test_the_precompute_hands_the_layers_its_positions(budget_run):
    """hand_context_positions wrapped V2's context precompute: its writes (every committed entry) come with
    their positions, which are those of their slots' offsets; the drafting forward's come with the block rows'
    positions its metadata gives, likewise those of their slots (both are un-rotated at them)."""
    speculator = budget_run["speculator"]
    model = speculator.spec.model
    owners = [o for o in (model, getattr(model, "model", None)) if hasattr(o, "precompute_and_store_context_kv")]
    assert owners and all(getattr(o.precompute_and_store_context_kv, "_fold_positions", False) for o in owners)
    impls = {id(layer.impl) for layer in speculator.draft_layers.values()}
    writes = budget_run["writes"]
    assert {id(w["impl"]) for w in writes} == impls
    handed = [w for w in writes if w["precompute"]]
    # one precompute write and one drafting write per layer and step
    assert len(handed) == len(writes) - len(handed) == len(impls) * len(SCHEDULE)
    for w in writes:
        valid = w["slots"] >= 0
        assert torch.equal(w["positions"][valid] % BLOCK, w["slots"][valid] % BLOCK)
    written = sum(int((w["slots"] >= 0).sum()) for w in handed)
    # the committed entries: every prompt, and each verify's bonus and accepted drafts
    committed = sum(len(p) for p in PROMPTS.values()) + sum(K - n + 1 for step in SCHEDULE for _, n in step
                                                            if isinstance(n, int))
    assert written == committed * len(impls)


def test_the_kept_bounds_are_the_committed_pages_bounds(budget_run):
    """On every call the layer's bounds exist, and on each request's pages that hold committed entries they are
    finite and equal the bounds of those entries as the cache holds them (un-rotated when written);
    the null block and the blocks no request ever held stay empty."""
    calls = budget_run["calls"]
    assert len(calls) == 2 * len(SCHEDULE)
    for i, call in enumerate(calls):
        bounds = call["bounds"]
        assert bounds is not None and bounds.dtype == torch.float32, f"call {i}"
        committed = [n - N_Q for n in call["seq_lens"]]
        keys = torch.nan_to_num(call["k"])
        exact, same_dtype = (far_pages.page_bounds(keys.to(dtype), BLOCK, cache_seqlens=committed)
                             for dtype in (torch.float64, torch.float32))
        for b, (n, table) in enumerate(zip(committed, call["tables"], strict=True)):
            pages = -(-n // BLOCK)
            kept = bounds[torch.tensor(table[:pages])]
            assert torch.isfinite(kept).all(), f"call {i} request {b}"
            check_close(f"call {i} request {b}", kept, exact[b, :pages], same_dtype[b, :pages], torch.float32)
        empty = bounds[torch.tensor([0] + budget_run["speculator"].free_blocks)]   # still free after the run
        assert (empty[:, :, 0] == float("-inf")).all() and (empty[:, :, 1] == float("inf")).all(), f"call {i}"


def budgeted_truth(call, upcast, far_budget=BUDGET):
    """``fold_attention_ref`` of the call with the budget over the kept bounds (gathered per request by its
    block table), or every far entry (``far_budget=None``)."""
    read = call["read"]
    q = call["q"].view(-1, N_Q, *call["q"].shape[1:])
    k, v = torch.nan_to_num(call["k"]), torch.nan_to_num(call["v"])
    num_pages = -(-k.shape[1] // BLOCK)
    kept = far_pages.empty_bounds(num_pages, k.shape[2], k.shape[3], batch=len(call["seq_lens"]))
    for b, table in enumerate(call["tables"]):
        kept[b, :len(table)] = call["bounds"][torch.tensor(table)]
    budget = {} if far_budget is None else dict(far_budget=far_budget, far_page=BLOCK, far_bounds=kept,
                                                far_rank=read.far_rank)
    out, _ = fold_attention_ref(q, k, v, window=read.window, rope=call["rope"], alpha=read.alpha,
                                cache_seqlens=call["seq_lens"], keys_rotated=False, queries_rotated=True,
                                softmax_scale=call["scale"], upcast=upcast, **budget)
    return out.flatten(0, 1)


def test_every_call_is_the_reference_budgeted_read(budget_run):
    calls = budget_run["calls"]
    bites = 0
    for i, call in enumerate(calls):
        ranked = 0
        read = call["read"]
        assert (read.read, read.window, read.far_budget, read.far_page, read.far_rank) == (
            "fold", WINDOW, BUDGET, BLOCK, budget_run["rank"])
        assert call["sinks"] is None and call["sliding"] is None and not call["causal"]
        for b, length in enumerate(call["seq_lens"]):
            assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any()
            # far for every row: entries < win_lo; the pages holding them wholly are the ranked candidates
            n = length - N_Q
            win_lo, far_hi = n - (WINDOW + N_Q) + 1, n - (WINDOW + N_Q) + N_Q
            candidates = win_lo // BLOCK
            straddlers = sum(t * BLOCK < far_hi and (t + 1) * BLOCK > win_lo for t in range(-(-length // BLOCK)))
            ranked += candidates > BUDGET // BLOCK - straddlers > 0              # a choice among candidates
        assert ranked, f"call {i}: no request chooses among its far pages"
        want = budgeted_truth(call, True)
        check_close(f"call {i} ({call['layer']})", call["out"], want, budgeted_truth(call, False), torch.float32)
        bites += (want - budgeted_truth(call, True, far_budget=None)).abs().max().item() > 1e-3
    assert bites == len(calls)              # in every call the budget leaves far pages out, and that shows
