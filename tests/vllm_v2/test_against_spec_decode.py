"""vLLM's V2 ``DFlashSpeculator`` with fold's backend drafts as the project's own loop, ``fold.spec_decode``, does.

The ``fold`` run (read ``"fold"``, window :data:`SMALL_W`, alpha 2.0) and the ``window`` run (read
``"window"``, window :data:`WIDE_W`) of ``test_speculator`` go through :data:`SCHEDULE`; for every step
and request row, ``fold.spec_decode``'s drafter (``fold.spec_decode.load_drafter`` of the same z-lab DFlash directory,
bound to the target vLLM was given, loaded with transformers) drafts the block ``[bonus, mask x K]``
after the row's committed tokens, reading its context with the read ``fold.spec_decode.make_read`` builds for
that policy (same window and alpha), its context features the target's hidden states
(``drafter.features``). Its logits are the truth in float64 (drafter and target ``.double()``) and the
tolerance rule's same-dtype twin in float32; vLLM's recorded float32 logits must be within
``reference.tolerance.check_close`` of them, and vLLM's drafts must be the float64 argmax.
"""

import json

import pytest
import torch
import transformers

import fold.spec_decode
from fold.vllm.config import parse_block
from reference.tolerance import check_close
from tests.vllm_v2.test_speculator import (K, SCHEDULE, SMALL_W, WIDE_W, fold_run, pair,  # noqa: F401 (fixtures)
                                           target, window_run)

ALPHA = 2.0
# per vLLM run: fold.spec_decode's policy and its options (what the run's drafter directory configures)
POLICY = {"fold_run": ("fold", "fold", dict(window=SMALL_W, alpha=ALPHA)),
          "window_run": ("window", "window", dict(window=WIDE_W))}


@pytest.fixture(scope="module")
def spec_drafters(pair):  # noqa: F811 (the imported fixture)
    """``{torch.float64: (drafter, target), torch.float32: (drafter, target)}``: fold.spec_decode's drafter of the
    pair's z-lab DFlash directory on the transformers target vLLM was given (float64: both ``.double()``)."""
    out = {}
    for dtype in (torch.float64, torch.float32):
        tgt = transformers.AutoModelForCausalLM.from_pretrained(str(pair["target"]), dtype=torch.float32).eval()
        drafter = fold.spec_decode.load_drafter(pair["drafter"], tgt).eval()
        if dtype == torch.float64:
            tgt, drafter = tgt.double(), drafter.double()      # the drafter's embedding / head are tgt's own
        assert drafter.fc.weight.dtype == dtype and tgt.lm_head.weight.dtype == dtype
        out[dtype] = (drafter, tgt)
    return out


@torch.no_grad()
def spec_logits(drafter, tgt, context, bonus, policy, options):
    """fold.spec_decode's slot logits ``[K, vocab]`` (in the drafter's dtype) of the block anchored at ``bonus``
    after ``context``, with a fresh read of ``policy`` (reads are per sequence)."""
    dtype = drafter.fc.weight.dtype
    ids = torch.tensor([list(context)])
    features = drafter.features(tgt(ids, output_hidden_states=True).hidden_states)      # [1, n, taps * H]
    state = drafter.new_state(len(context), ids.device, dtype)
    drafter.append_context(state, features)
    read = fold.spec_decode.make_read(policy, drafter.cfg.rope, backend="torch", **options)
    return drafter.head(drafter.slot_hidden(state, int(bonus), read))


@pytest.mark.parametrize("name", list(POLICY))
def test_vllm_drafts_equal_fold_spec(name, request, pair, spec_drafters):  # noqa: F811 (the imported fixture)
    result = request.getfixturevalue(name)
    policy, directory, options = POLICY[name]
    # the run's drafter directory configures the read fold.spec_decode is given here
    served = parse_block(json.loads((pair[directory] / "config.json").read_text())["fold"])
    assert served.read == policy and served.window == options["window"]
    if policy == "fold":
        assert served.alpha == options["alpha"]
    (d64, t64), (d32, t32) = spec_drafters[torch.float64], spec_drafters[torch.float32]
    assert d64.cfg.block_size == K + 1 and all(w is None for w in d64.cfg.layer_windows)
    rows = 0
    for i, step in enumerate(result["steps"]):
        assert step["logits"].shape[0] == len(step["context"]) * K
        for r, (context, bonus) in enumerate(zip(step["context"], step["bonus"], strict=True)):
            if policy == "fold":
                assert len(context) > SMALL_W        # fold.spec_decode reads far memory here too, not the plain read
            truth = spec_logits(d64, t64, context, bonus, policy, options)
            assert truth.dtype == torch.float64 and truth.shape == (K, step["logits"].shape[1])
            twin = spec_logits(d32, t32, context, bonus, policy, options)
            assert twin.dtype == torch.float32
            got = step["logits"][r * K:(r + 1) * K]
            assert got.dtype == torch.float32
            check_close(f"{name} step {i} row {r}", got, truth, twin, torch.float32)
            assert step["drafts"][r].tolist() == truth.argmax(-1).tolist(), f"{name} step {i} row {r}"
            rows += 1
    assert rows == sum(len(step) for step in SCHEDULE)
