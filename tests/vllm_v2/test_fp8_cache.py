"""An FP8 drafter cache through vLLM 0.34's V2 ``DFlashSpeculator`` (CPU): ``kv_cache_dtype`` ``fp8`` and
``fp8_e5m2`` set for the drafter alone (``speculative_config["kv_cache_dtype"]``, as V2's DFlash loader
hands it to the drafter's cache config), with the layer's scales.

vLLM builds the drafter's cache as uint8 pages; fold's layers write ``x / scale`` in FP8 (the context
precompute's keys and values and the block's own) and read them dequantized. The scales are set on
each draft layer (``_k_scale`` / ``_v_scale`` and their host copies, as a checkpoint's KV scales set
them after loading) to :data:`K_SCALE` and :data:`V_SCALE`, so a read or write that drops them shows.
Checked: every call against ``reference.fold_attention_ref`` over the cache as read back with those
scales (float64, the tolerance rule), and, at the first step (the prompts, the same in every run),
the dequantized context entries are exactly torch's FP8 round trip of the float32 run's entries with
those scales (the write quantizes ``x / scale``, nothing else).
"""

import pytest
import torch

from fold.vllm.backend import FoldAttentionImpl
from reference.tolerance import check_close
from tests.vllm.pair import TAPS
from tests.vllm_v2.harness import SHORT_SCHEDULE, K, Speculator, Target, fold_pair, recorded_rounds, truth

K_SCALE, V_SCALE = 0.05, 0.02            # a cache entry is x / scale: 20x and 50x the values
DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCHEDULE = SHORT_SCHEDULE


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    return fold_pair(v2_process, tmp_path_factory.mktemp("v2-fp8"))


@pytest.fixture(scope="module")
def target(pair):
    return Target(pair["target"], TAPS)


def fp8_run(pair, target, cache_dtype):
    speculator = Speculator(pair["target"], pair["fold"], kv_cache_dtype=cache_dtype)
    if cache_dtype != "auto":
        for layer in speculator.draft_layers.values():
            layer._k_scale.fill_(K_SCALE)
            layer._v_scale.fill_(V_SCALE)
            layer._k_scale_float, layer._v_scale_float = K_SCALE, V_SCALE
    return recorded_rounds(speculator, target, SCHEDULE)


@pytest.fixture(scope="module")
def float32_run(pair, target):
    return fp8_run(pair, target, "auto")


@pytest.fixture(scope="module", params=sorted(DTYPES))
def run(request, pair, target):
    return dict(fp8_run(pair, target, request.param), cache_dtype=request.param)


def test_the_drafter_cache_is_fp8_and_the_targets_config_is_not(run):
    speculator = run["speculator"]
    assert speculator.config.cache_config.cache_dtype == "auto"          # the target's, as it was
    assert speculator.config.speculative_config.kv_cache_dtype == run["cache_dtype"]
    for name, layer in speculator.draft_layers.items():
        assert type(layer.impl) is FoldAttentionImpl
        assert layer.kv_cache_dtype == layer.impl.kv_cache_dtype == run["cache_dtype"]
        assert layer.impl.cache_dtype == DTYPES[run["cache_dtype"]]
        assert speculator.kv_caches[name].dtype == torch.uint8
        assert layer.impl.scales(layer) == (K_SCALE, V_SCALE)
        assert layer.query_quant is None        # fold's read takes the query unquantized


def test_every_call_equals_the_reference_on_the_dequantized_cache(run):
    calls = run["calls"]
    assert len(calls) == 2 * len(SCHEDULE)
    for i, call in enumerate(calls):
        for b, length in enumerate(call["seq_lens"]):        # every entry the read covers was written
            assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any()
        check_close(f"{run['cache_dtype']} call {i} ({call['layer']})", call["out"], truth(call, True),
                    truth(call, False), torch.float32)


def test_the_cache_holds_x_over_its_scale_in_fp8(run, float32_run):
    dtype = DTYPES[run["cache_dtype"]]
    first = [c for c in run["calls"][:2]]
    reference = float32_run["calls"][:2]
    for call, plain in zip(first, reference, strict=True):
        assert call["layer"] == plain["layer"] and call["seq_lens"] == plain["seq_lens"]
        for b, length in enumerate(call["seq_lens"]):
            n = length - (K + 1)                               # the prompt's entries, written by the precompute
            for i, scale in ((0, K_SCALE), (1, V_SCALE)):
                x = (plain["k"], plain["v"])[i][b, :n]
                want = (x / scale).to(dtype).float() * scale
                got = (call["k"], call["v"])[i][b, :n]
                assert torch.equal(got, want), f"{call['layer']} request {b} {'kv'[i]}"
                assert not torch.equal(got, x)                  # quantized: not the float32 values
