"""A sliding-window DFlash drafter read ``"fold"`` through vLLM 0.34's V2 ``DFlashSpeculator`` (CPU).

Two drafters of the pair's weights whose config.json make their layers slide over a window of
:data:`SLIDING` = 16 entries, shorter than the contexts :data:`SCHEDULE` reaches (up to 35):

- ``mixed``: ``layer_types = [sliding_attention, full_attention]`` (Gemma-4 DFlash style): layer 0
  slides and reads its block causally, layer 1 is full attention, non-causal;
- ``swa``: ``dflash_config.use_swa`` (MiMo style): both layers slide, non-causal.

FOLD's per-layer rule for them: the layer's native window is the local branch, every older entry far
memory (read at the shared position ``window + n_q + r``). So fold's layers ask vLLM for a full-attention
cache (a ``SlidingWindowSpec`` would let vLLM free the pages that leave the window), each call must be
``reference.fold_attention_ref`` with the layer's ``sliding_window`` and causality over the cache as
read back, and the drafts the plain float64 forward's with that read.
"""

import json

import pytest
import torch

import fold.vllm
from fold.vllm.backend import FoldAttentionImpl
from fold.vllm.config import parse_block
from reference import fold_attention_ref
from reference.tolerance import check_close
from tests.vllm.pair import MASK_ID, TAPS, make_drafter
from tests.vllm_v2.harness import K, PlainDFlash, check_against_plain, Speculator, Target, recorded_rounds, truth

SLIDING = 16            # the layers' native window: shorter than the contexts below
SMALL_W = 8             # the fold block's window (sets the far position, window + n_q + r)
DFLASH = dict(block_size=4, target_layer_ids=list(TAPS), mask_token_id=MASK_ID)
DRAFTERS = {
    "mixed": (dict(layer_types=["sliding_attention", "full_attention"],
                   dflash_config=dict(DFLASH, swa_window_size=SLIDING)), [(SLIDING, True), (None, False)]),
    "swa": (dict(dflash_config=dict(DFLASH, use_swa=True, swa_window_size=SLIDING)),
            [(SLIDING, False), (SLIDING, False)]),
}
PROMPTS = {0: list(range(3, 30)), 1: [5 + (7 * i) % 200 for i in range(13)], 2: list(range(40, 60))}
SCHEDULE = [                    # (slot, prompt | drafts rejected); contexts 27 -> 35, 13 -> 22, 20 -> 22
    [(0, PROMPTS[0]), (1, PROMPTS[1])],
    [(0, 0), (1, 2)],
    [(0, K), (1, 0), (2, PROMPTS[2])],
    [(0, 1), (1, K), (2, 2)],
]
MAX_CONTEXT = 35


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    pair = v2_process.make_pair(tmp_path_factory.mktemp("v2-sliding"))
    for name, (overrides, _) in DRAFTERS.items():
        source = make_drafter(pair["root"] / f"drafter-{name}", config_overrides=overrides)
        pair[name] = fold.vllm.configure(source, pair["root"] / f"drafter-{name}-fold", read="fold", window=SMALL_W,
                                         alpha=2.0, backend="torch")
    return pair


@pytest.fixture(scope="module")
def target(pair):
    return Target(pair["target"], TAPS)


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def sliding_run(request, pair, target):
    run = recorded_rounds(Speculator(pair["target"], pair[request.param]), target, SCHEDULE)
    return dict(run, name=request.param, modes=DRAFTERS[request.param][1])


def layer_modes(run):
    """Draft layer name -> its expected ``(sliding_window, causal)`` (vLLM numbers the drafter's layers on
    from the target's: the i-th of them in order is config.json's layer i)."""
    names = sorted(run["speculator"].draft_layers, key=lambda n: int(n.split("layers.")[1].split(".")[0]))
    return dict(zip(names, run["modes"], strict=True))


# (a) the layers keep their window and causality in fold's impl, and vLLM builds them a full-attention cache

def test_fold_layers_keep_the_window_and_ask_for_a_full_attention_cache(sliding_run):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    speculator, modes = sliding_run["speculator"], layer_modes(sliding_run)
    layers = speculator.draft_layers
    assert len(layers) == 2
    for name, layer in layers.items():
        assert type(layer.impl) is FoldAttentionImpl
        assert (layer.impl.sliding_window, layer.impl.causal) == modes[name], name
        assert layer.sliding_window is None, name                 # what vLLM's cache spec is built from
    specs = {n: s for n, s in get_kv_cache_spec(speculator.config).items() if n in layers}
    assert set(specs) == set(layers)
    assert all(type(s) is FullAttentionSpec and not isinstance(s, SlidingWindowSpec) for s in specs.values())
    groups = speculator.kv_cache_config.kv_cache_groups
    assert len(groups) == 1 and set(groups[0].layer_names) == set(layers)      # one full group: nothing freed
    assert type(groups[0].kv_cache_spec) is FullAttentionSpec
    # the spec follows the layer's window: with its native one it would be a sliding-window spec
    name, layer = next((n, m) for n, m in layers.items() if m.impl.sliding_window is not None)
    layer.sliding_window = layer.impl.sliding_window
    try:
        native = layer.get_kv_cache_spec(speculator.config)
    finally:
        layer.sliding_window = None
    assert isinstance(native, SlidingWindowSpec) and native.sliding_window == SLIDING


# (b) every call is the reference with the layer's window and causality; the old pages are all there

def test_every_call_equals_the_reference_with_the_layers_window(sliding_run):
    calls, modes = sliding_run["calls"], layer_modes(sliding_run)
    assert len(calls) == 2 * len(SCHEDULE) and all(not c["dummy"] and c["n_q"] == K + 1 for c in calls)
    assert max(n for c in calls for n in c["seq_lens"]) == MAX_CONTEXT + K + 1
    far = 0
    for i, call in enumerate(calls):
        name = f"call {i} ({call['layer']})"
        assert (call["sliding"], call["causal"]) == modes[call["layer"]], name
        assert call["read"].read == "fold" and call["read"].window == SMALL_W
        for b, length in enumerate(call["seq_lens"]):      # every entry up to seq_len was written and kept
            assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any(), name
        check_close(name, call["out"], truth(call, True), truth(call, False), torch.float32)
        if call["sliding"] is not None:
            # rows whose native window leaves context entries behind: those are read as far memory, so the
            # output is not the native sliding read (far_position "none": the old entries dropped)
            n_far = sum(length - (K + 1) - call["sliding"] + 1 > 0 for length in call["seq_lens"])
            if n_far:
                far += n_far
                q = call["q"].view(-1, K + 1, *call["q"].shape[1:])
                native, _ = fold_attention_ref(q, torch.nan_to_num(call["k"]), torch.nan_to_num(call["v"]),
                                               window=SMALL_W, rope=call["rope"], alpha=1.0,
                                               cache_seqlens=call["seq_lens"], keys_rotated=False, queries_rotated=True,
                                               softmax_scale=call["scale"], far_position="none",
                                               sliding_window=call["sliding"], causal=call["causal"])
                assert (native.flatten(0, 1) - call["out"].double()).abs().max() > 1e-3, name
    # on every sliding layer, each request whose context reaches the window (n >= 16: 1 + 1 + 3 + 3 of them)
    sliding_layers = sum(m[0] is not None for m in modes.values())
    past = sum(len(context) >= SLIDING for step in sliding_run["steps"] for context in step["context"])
    assert past == 8 and far == sliding_layers * past


# (c) the drafts are the plain float64 forward's with the reference read, layer by layer

def test_drafts_equal_a_plain_pytorch_dflash_with_the_per_layer_read(sliding_run, pair, target):
    drafter = pair[sliding_run["name"]]
    plain, plain32 = PlainDFlash(drafter, target), PlainDFlash(drafter, target, torch.float32)
    assert plain.modes == sliding_run["modes"]                   # the plain forward's own reading of config.json
    read = parse_block(json.loads((drafter / "config.json").read_text())["fold"])
    check_against_plain(sliding_run["steps"], plain, plain32, read)
