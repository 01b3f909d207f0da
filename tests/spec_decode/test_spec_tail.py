"""``tail="shrink"``: a block drafter's last rounds draft only the slots the tokens left need (upstream
DFlash's ``[anchor, MASK x (left - 1)]``); the output stays the target's greedy output under every policy.
Parity with upstream's own loop: tests/spec_decode/test_upstream_parity.py."""

import pytest
import torch

from fold import spec_decode
from tests.spec_decode_fixtures import OPTIONS, greedy_ar, make_drafter, make_glide, make_target, padded_batch

NEW = 13                    # block 4: full blocks, then the last rounds with 1 or 2 tokens left


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target("qwen3", tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """``"zlab-swa"`` (sliding + full layers) and ``"dspark"`` (every slot drafts, Markov-corrected)."""
    return {fmt: spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp(fmt), target, fmt), target)
            for fmt in ("zlab-swa", "dspark")}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g) for n in lengths]


def _drafts_per_round(committed, full_drafts, shrink):
    """What each round drafts: the whole block's slots, or with ``shrink`` at most the tokens still left
    (the prefill gives the first token)."""
    left, out = NEW - 1, []
    for c in committed:
        out.append(min(full_drafts, left) if shrink else full_drafts)
        left -= c
    return out


@pytest.mark.parametrize("fmt, policy, tail", [("zlab-swa", p, "shrink") for p in sorted(OPTIONS)]
                         + [("dspark", "fold", "shrink"), ("dspark", "dflash", "shrink"), ("zlab-swa", "fold", "full")])
def test_each_tail_rule_is_lossless_at_batch_three(target, drafters, fmt, policy, tail):
    drafter, prompts = drafters[fmt], _prompts([30, 11, 22], seed=1)
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=NEW, policy=policy,
                                  tail=tail, **OPTIONS[policy])
    full_drafts = drafter.cfg.block_size - (not drafter.cfg.sample_from_anchor)
    for b, p in enumerate(prompts):
        assert torch.equal(result.sequences[b, :len(p) + NEW], greedy_ar(target, p, NEW))
        stats = result.stats["per_sequence"][b]
        drafts = _drafts_per_round(stats["committed_per_round"], full_drafts, tail == "shrink")
        assert stats["drafted_tokens"] == sum(drafts)
        assert min(drafts) < full_drafts or tail == "full"          # a last round was shortened


@pytest.mark.parametrize("fmt", ["zlab-swa", "dspark"])
def test_a_shrunk_tree_is_lossless(target, drafters, fmt):
    drafter = drafters[fmt]
    prompts = _prompts([25, 14], seed=2)
    ids, mask = padded_batch(prompts, "right")
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=NEW, policy="fold",
                                  window=8, tree=(2, 2), tail="shrink")
    for b, p in enumerate(prompts):
        assert torch.equal(result.sequences[b, :len(p) + NEW], greedy_ar(target, p, NEW))


@pytest.mark.parametrize("tail, error, match", [
    ("half", ValueError, r"tail must be one of \('full', 'shrink'\)"),
    (None, TypeError, "tail must be one of"),
])
def test_a_bad_tail_is_refused_by_name(target, drafters, tail, error, match):
    with pytest.raises(error, match=match):
        spec_decode.generate(target, drafters["zlab-swa"], _prompts([9])[0][None], max_new_tokens=3, tail=tail)


def test_glide_refuses_shrink(target, tmp_path):
    glide = spec_decode.load_drafter(make_glide(tmp_path, target), target)
    with pytest.raises(ValueError, match="tail='shrink' shapes a block drafter's block"):
        spec_decode.generate(target, glide, _prompts([9])[0][None], max_new_tokens=3, tail="shrink")
