"""``fold.spec_decode`` with the stock read (``policy="dflash"``) beside z-lab's own loop, ``dflash_generate``
of ``dflash==0.1.0``, on the same tiny random checkpoints (DFlash and DFlash 2, each with full, causal
sliding and bidirectional sliding layers: ``tests.upstream_fixtures.KINDS``): the same weights loaded, and
round by round the same anchor, drafts (DFlash 2: the selector's greedy path) and acceptance;
``tail="shrink"`` matches upstream's shortened last blocks too.

Float64 throughout, so that random weights' near-tied argmaxes cannot flip between the two loops'
rounding (upstream forms RoPE angles in float32, fold in float64: logits differ far below any gap here).
A vocabulary of 16 makes random drafts right often enough that acceptance lengths are compared.
"""

import pytest
import torch
from safetensors.torch import load_file

from fold import spec_decode
from tests.spec_decode_fixtures import greedy_ar, make_target
from tests.upstream_fixtures import (KINDS, checkpoint_state, greedy_acceptance, import_upstream, make_kind, run_fold,
                                     run_upstream, upstream_drafter)

upstream = import_upstream()
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

VOCAB = 16
PROMPT, NEW = 20, 41                  # the sliding layers' window (5) is far shorter than the prompt


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target("qwen3", tmp_path_factory.mktemp("target"), vocab=VOCAB).to(torch.float64)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, target, tmp_path_factory):
    """``(fold's drafter, upstream's drafter, checkpoint directory)`` of one checkpoint."""
    path = make_kind(request.param, tmp_path_factory.mktemp(request.param), target)
    return spec_decode.load_drafter(path, target), upstream_drafter(upstream, path), path


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, VOCAB - 1, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def test_loaded_weights_and_layer_rules_equal(pair):
    ours, theirs, path = pair
    mine, up, stored = ours.state_dict(), checkpoint_state(theirs), load_file(path / "model.safetensors")
    assert sorted(mine) == sorted(up) == sorted(stored)
    for name in mine:
        assert mine[name].dtype == up[name].dtype == torch.float64, name
        assert torch.equal(mine[name], up[name]) and torch.equal(mine[name], stored[name].double()), name
    cfg = ours.cfg
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == \
           (theirs.block_size, theirs.mask_token_id, list(theirs.target_layer_ids))
    assert cfg.layer_windows == [layer.self_attn.sliding_window for layer in theirs.layers]
    assert cfg.layer_causal == [layer.self_attn.is_causal for layer in theirs.layers]


def _check_acceptance(rounds, committed, accepted, up_committed, greedy, end):
    """Each loop's acceptance is what its drafts earn against the target's greedy output: fold verifies
    ``a + 1`` tokens and commits at most those left, as upstream does."""
    a = greedy_acceptance(rounds, greedy)
    assert [n - 1 for n in accepted] == a
    capped = [min(k + 1, end - position - 1) for k, (position, _, _) in zip(a, rounds)]
    assert committed == capped == up_committed


def test_full_block_rounds_equal_upstream(target, pair, prompt, monkeypatch):
    """``tail="full"`` (the default): every round where upstream drafts a whole block is fold's round."""
    ours, theirs, _ = pair
    up_ids, up_committed, up_rounds = run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    ids, committed, accepted, rounds = run_fold(target, ours, prompt, NEW, policy="dflash")
    greedy = greedy_ar(target, prompt[0], NEW)
    assert torch.equal(ids[0], greedy) and torch.equal(up_ids[0], greedy)

    drafts = ours.cfg.block_size - 1
    full = [i for i, (_, _, d) in enumerate(up_rounds) if len(d) == drafts]
    assert full == list(range(len(full))) and len(full) < len(up_rounds)      # full blocks, then a shorter tail
    assert rounds[:len(full)] == up_rounds[:len(full)]
    assert committed[:len(full)] == up_committed[:len(full)]
    long = greedy_ar(target, prompt[0], NEW + drafts)              # what drafts past the end would earn
    _check_acceptance(rounds, committed, accepted, committed, long, PROMPT + NEW)
    assert max(accepted[:len(full)]) >= 2                          # some full-block round accepted a draft


def test_every_round_equals_upstream_with_tail_shrink(target, pair, prompt, monkeypatch):
    """``tail="shrink"`` drafts the last blocks as upstream does: every round is the same, tail included."""
    ours, theirs, _ = pair
    up_ids, up_committed, up_rounds = run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    ids, committed, accepted, rounds = run_fold(target, ours, prompt, NEW, policy="dflash", tail="shrink")
    assert torch.equal(ids, up_ids)
    assert rounds == up_rounds
    assert any(len(d) < ours.cfg.block_size - 1 for _, _, d in rounds)          # the tail was shortened
    _check_acceptance(rounds, committed, accepted, up_committed, greedy_ar(target, prompt[0], NEW + 1),
                      PROMPT + NEW)
