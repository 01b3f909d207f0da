"""The ``"fold"`` read in bfloat16 through vLLM 0.34's V2 ``DFlashSpeculator`` (CPU): the dtype GPUs serve in.

The speculator is built with ``dtype="bfloat16"`` (the drafter's weights, activations and KV cache in
bf16) and the target's hidden states handed over in bf16, as a bf16 target produces them. Each fold
call is held to the float64 reference by the tolerance rule in bfloat16 (``reference.tolerance``: twice
PyTorch's own bf16 error on the same inputs, plus a floor), as ``tests/vllm/test_engine_modes.py`` holds
the V1 engine's bf16 calls. (That rule's floor, 16 bf16 eps times the largest output, is loose at
these outputs: an alpha of 2.25 for 2.0 passes it; tightening it belongs in reference/tolerance.py, for
every test at once, not here.) The drafts are not compared with the float64 plain forward: in bf16 a
draft may flip on a near tie of the logits.
"""

import pytest
import torch

from fold.vllm.backend import FoldAttentionImpl
from reference.tolerance import check_close
from tests.vllm.pair import TAPS
from tests.vllm_v2.harness import K, Speculator, Target, recorded_rounds, truth, with_block

SMALL_W = 8
PROMPTS = {0: list(range(3, 30)), 1: [5 + (7 * i) % 200 for i in range(20)]}
SCHEDULE = [
    [(0, PROMPTS[0]), (1, PROMPTS[1])],
    [(0, 0), (1, 2)],
    [(0, K), (1, 1)],
]


@pytest.fixture(scope="module")
def bf16_run(v2_process, tmp_path_factory):
    pair = v2_process.make_pair(tmp_path_factory.mktemp("v2-bf16"))
    drafter = with_block(pair, "drafter-fold", read="fold", window=SMALL_W, alpha=2.0)
    speculator = Speculator(pair["target"], drafter, dtype="bfloat16")
    return recorded_rounds(speculator, Target(pair["target"], TAPS, dtype=torch.bfloat16), SCHEDULE)


def test_the_speculator_serves_in_bf16(bf16_run):
    speculator = bf16_run["speculator"]
    assert speculator.config.model_config.dtype == torch.bfloat16
    assert all(type(layer.impl) is FoldAttentionImpl for layer in speculator.draft_layers.values())
    assert all(cache.dtype == torch.bfloat16 for name, cache in speculator.kv_caches.items()
               if name in speculator.draft_layers)
    assert all(step["drafts"].shape == (len(s), K) for step, s in zip(bf16_run["steps"], SCHEDULE, strict=True))


def test_bf16_fold_calls_equal_the_reference_by_the_bf16_rule(bf16_run):
    calls = bf16_run["calls"]
    assert len(calls) == 2 * len(SCHEDULE)
    far = 0
    for i, call in enumerate(calls):
        assert call["q"].dtype == call["out"].dtype == call["k"].dtype == torch.bfloat16
        assert call["read"].read == "fold" and call["read"].window == SMALL_W
        for b, length in enumerate(call["seq_lens"]):
            assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any()
            far += length - (K + 1) >= SMALL_W + K + 1             # row 0 reads far memory
        want = truth(call, True)
        check_close(f"call {i} ({call['layer']})", call["out"], want, truth(call, False), torch.bfloat16)
    assert far == 2 * sum(len(step) for step in SCHEDULE)
