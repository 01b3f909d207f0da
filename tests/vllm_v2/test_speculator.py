"""fold's backend on the draft layers of vLLM 0.34's V2 ``DFlashSpeculator``, driven directly on a CPU.

Three speculators on the same tiny random pair (``harness.make_pair``), each through the same schedule
of ``propose`` steps (:data:`SCHEDULE`: prefills, verifies with 0, some and all drafts rejected, a batch
mixing a prefill with verifies, a request leaving): the drafter with a ``fold`` block reading
``"window"`` over a window longer than every context (``window``), without a block (vLLM's stock
read, ``stock``: the Triton attention backend, in Triton's interpreter), and reading ``"fold"`` with a
window of 8 (``fold``: far memory from the first step). ``harness.PlainDFlash`` (float64 plain PyTorch,
no vLLM) is the independent check of the drafts; ``reference.fold_attention_ref`` that of each fold call.
"""

import json
import warnings

import pytest
import torch

from fold.vllm.backend import FoldAttentionBackend, FoldAttentionImpl, FoldMetadataBuilder
from fold.vllm.config import parse_block
from reference.tolerance import check_close
from tests.vllm.pair import TAPS, VOCAB
from tests.vllm_v2.harness import (K, PlainDFlash, Recorder, Speculator, Target, check_against_plain, keep_attention,
                                   run_rounds, truth, with_block)

WIDE_W = 64         # longer than every context below: the window read is then full attention
SMALL_W = 8         # shorter than every context: most entries are far memory
PROMPTS = {2: list(range(3, 30)), 0: [5 + (7 * i) % 200 for i in range(13)], 1: list(range(40, 54))}
# per propose step: (request-state slot, prompt -> its prefill | number of the previous drafts rejected).
# Slot 3 starts, in step 2, from slot 0's tokens after slot 0's verify in that step (a callable), and
# is then verified like slot 0: its drafts must stay slot 0's.
SCHEDULE = [
    [(2, PROMPTS[2]), (0, PROMPTS[0])],
    [(2, 0), (0, 2)],
    [(2, K), (0, 0), (1, PROMPTS[1]), (3, lambda requests: requests[0].tokens)],
    [(2, 1), (0, K), (1, 2), (3, K)],
    [(0, 1), (1, 0), (3, 1)],
]
MAX_CONTEXT = 35    # the longest context the schedule reaches (slot 2: 27 + 4 + 1 + 3)


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    pair = v2_process.make_pair(tmp_path_factory.mktemp("v2-pair"))
    pair["window"] = with_block(pair, "drafter-window", read="window", window=WIDE_W)
    pair["fold"] = with_block(pair, "drafter-fold", read="fold", window=SMALL_W, alpha=2.0)
    return pair


@pytest.fixture(scope="module")
def target(pair):
    return Target(pair["target"], TAPS)


def run(pair, target, drafter):
    """A fresh speculator for ``pair[drafter]`` through :data:`SCHEDULE`, every drafter attention call kept."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    speculator = Speculator(pair["target"], pair[drafter])
    with Recorder(FoldAttentionImpl, "forward", keep_attention) as calls, \
            Recorder(TritonAttentionImpl, "forward", lambda impl, a, kw, out: impl) as stock, \
            warnings.catch_warnings():
        # the stock kernel (kernel_unified_attention) divides 0 by 0 in rows it masks, which Triton's interpreter
        # (numpy) reports, on a zero-filled cache too; its drafts are checked against a plain forward below
        warnings.filterwarnings("ignore", "invalid value encountered in divide", RuntimeWarning)
        steps = run_rounds(speculator, target, SCHEDULE)
    return dict(speculator=speculator, steps=steps, calls=calls.calls, stock_calls=stock.calls)


@pytest.fixture(scope="module")
def window_run(pair, target):
    return run(pair, target, "window")


@pytest.fixture(scope="module")
def stock_run(pair, target):
    return run(pair, target, "drafter")


@pytest.fixture(scope="module")
def fold_run(pair, target):
    return run(pair, target, "fold")


@pytest.fixture(scope="module")
def plain(pair, target):
    return PlainDFlash(pair["drafter"], target)


@pytest.fixture(scope="module")
def plain32(pair, target):
    """The same forward in float32: what PyTorch itself gets, for the tolerance rule."""
    return PlainDFlash(pair["drafter"], target, torch.float32)


# (a) fold's impl serves every draft layer, and is what runs

@pytest.mark.parametrize("name", ["window_run", "fold_run"])
def test_fold_serves_every_draft_layer_and_runs(name, request):
    result = request.getfixturevalue(name)
    speculator = result["speculator"]
    layers = speculator.draft_layers
    assert len(layers) == 2 and set(layers) == speculator.spec.draft_attn_layer_names
    for layer in layers.values():
        assert type(layer.impl) is FoldAttentionImpl
        assert layer.get_attn_backend() is FoldAttentionBackend
        assert layer.sliding_window is None
    groups = [g for gs in speculator.spec.attn_groups for g in gs]
    assert groups and all(g.backend is FoldAttentionBackend for g in groups)
    assert {n for g in groups for n in g.layer_names} == set(layers)
    assert all(type(g.get_metadata_builder()) is FoldMetadataBuilder for g in groups)
    assert speculator.spec.supports_decode_metadata_update       # fold's builder declares in-place updates
    # every step ran fold's forward once per draft layer, on a uniform drafting batch, and nothing else ran
    calls = result["calls"]
    assert [c["layer"] for c in calls] == [name for _ in SCHEDULE for name in sorted(layers)]
    assert all(not c["dummy"] and c["uniform"] and c["n_q"] == K + 1 for c in calls)
    assert [c["num_reqs"] for c in calls[::2]] == [len(step) for step in SCHEDULE]
    assert result["stock_calls"] == []


def test_the_draft_step_is_captured_in_full_decode_graphs(pair, monkeypatch):
    """What V2's DFlash speculator decides from fold's builder: its draft groups' weakest CUDA-graph support is
    fold's UNIFORM_BATCH, so a FULL cudagraph mode captures the draft step as FULL_DECODE_ONLY (not eager).
    Nothing is captured here (no GPU): the CPU platform's graph pool is a stand-in."""
    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import interface
    from vllm.v1.attention.backend import AttentionCGSupport

    speculator = Speculator(pair["target"], pair["fold"])
    support = speculator.spec.attn_cg_support
    assert support.min_cg_support == AttentionCGSupport.UNIFORM_BATCH
    assert support.min_cg_attn_backend == FoldAttentionBackend.__name__
    monkeypatch.setattr(interface.UnspecifiedPlatform, "get_global_graph_pool", classmethod(lambda cls: object()))
    with set_current_vllm_config(speculator.config):
        speculator.spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert speculator.spec.query_cudagraph_manager.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY


def test_the_stock_run_keeps_vllms_read(stock_run):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    layers = stock_run["speculator"].draft_layers
    assert all(type(layer.impl) is TritonAttentionImpl for layer in layers.values())
    assert stock_run["calls"] == [] and len(stock_run["stock_calls"]) == len(SCHEDULE) * len(layers)


# (b) a window read over contexts shorter than the window drafts as vLLM's stock read does

def test_window_read_within_the_window_drafts_as_the_stock_read(window_run, stock_run):
    assert max(len(c) for s in window_run["steps"] for c in s["context"]) == MAX_CONTEXT <= WIDE_W
    for i, (ours, theirs) in enumerate(zip(window_run["steps"], stock_run["steps"], strict=True)):
        assert ours["rows"] == theirs["rows"]
        assert torch.equal(ours["drafts"], theirs["drafts"]), f"step {i}"   # logits: both against the plain truth


@pytest.mark.parametrize("name", ["stock_run", "window_run"])
def test_drafts_equal_a_plain_pytorch_dflash(name, request, plain, plain32):
    """The harness itself: vLLM's logits (stock read, and fold's window read) are an independent float64
    DFlash forward's by the tolerance rule, and its drafts that forward's argmax, from the committed
    tokens alone."""
    check_against_plain(request.getfixturevalue(name)["steps"], plain, plain32)


# (c) reading "fold" past the window: every call is the reference's, and the drafts a plain forward's

def test_fold_read_calls_equal_the_reference(fold_run):
    calls = fold_run["calls"]
    assert len(calls) == 2 * len(SCHEDULE)
    far = 0
    for i, call in enumerate(calls):
        assert call["read"].read == "fold" and call["read"].window == SMALL_W and call["read"].alpha == 2.0
        for b, length in enumerate(call["seq_lens"]):        # every entry the read covers was written
            assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any()
            far += length - (K + 1) >= SMALL_W + K + 1       # a context of n >= W + n_q: row 0 reads far memory
        check_close(f"call {i} ({call['layer']})", call["out"], truth(call, True), truth(call, False), torch.float32)
    assert far == sum(len(step) for step in SCHEDULE) * 2      # every request of every call reads far memory


def test_fold_read_drafts_equal_a_plain_pytorch_dflash_with_the_reference_read(fold_run, plain, plain32, pair):
    read = parse_block(json.loads((pair["fold"] / "config.json").read_text())["fold"])
    check_against_plain(fold_run["steps"], plain, plain32, read)


# (d) prefills and verifies with 0 and >0 rejections

@pytest.mark.parametrize("name", ["window_run", "stock_run", "fold_run"])
def test_steps_with_and_without_rejections_draft_k_tokens_per_request(name, request):
    steps = request.getfixturevalue(name)["steps"]
    verified = [n for step in SCHEDULE for _, n in step if isinstance(n, int)]
    assert 0 in verified and any(0 < n < K for n in verified) and K in verified
    for step, scheduled in zip(steps, SCHEDULE, strict=True):
        assert step["rejected"] == [n if isinstance(n, int) else 0 for _, n in scheduled]
        drafts = step["drafts"]
        assert drafts.shape == (len(scheduled), K) and drafts.dtype == torch.int64
        assert bool(((drafts >= 0) & (drafts < VOCAB)).all())
        assert [state for state, _ in step["rows"]] == [state for state, _ in scheduled]
    assert len({tuple(row) for step in steps for row in step["drafts"].tolist()}) > 5   # the drafts vary


@pytest.mark.parametrize("name", ["window_run", "stock_run", "fold_run"])
def test_a_request_after_rejections_drafts_as_a_fresh_one_with_its_tokens(name, request):
    """Slot 3 is prefilled with slot 0's committed tokens after slot 0 had drafts rejected (on other pages,
    in a batch mixing prefill and verify rows) and then verified alike: their drafts stay equal, so the
    rejected rows' K/V are never read and the committed ones are rewritten as context."""
    steps = request.getfixturevalue(name)["steps"]
    compared = 0
    for i, step in enumerate(steps):
        states = [state for state, _ in step["rows"]]
        if 3 in states:
            a, b = states.index(0), states.index(3)
            assert step["context"][a] == step["context"][b] and step["bonus"][a] == step["bonus"][b]
            assert step["drafts"][a].tolist() == step["drafts"][b].tolist(), f"step {i}"   # logits: vs truth above
            compared += 1
    assert compared == 3
