"""``draft_len`` and ``draft_cutoff``: shorter chains, the same output."""

import pytest
import torch

from fold import spec_decode
from fold.spec_decode.generate import BlockProposer
from fold.spec_decode.policies import make_read
from tests.spec_decode_fixtures import greedy_ar, make_drafter, make_glide, make_target, padded_batch


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target("qwen3", tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module", params=["zlab", "dspark"])        # dspark: the Markov-corrected chain
def drafter(request, target, tmp_path_factory):
    return spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp(request.param), target, request.param,
                                          block_size=8), target)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g) for n in lengths]


@torch.no_grad()
def _slot_confidence(drafter, state, anchor, read, tokens):
    """Top probability of the distribution each greedy slot drafts from (Markov bias on the previous draft)."""
    logits, prev, conf = drafter.slot_logits(state, anchor, read), anchor, []
    for k, token in enumerate(tokens):
        row = logits[k] + drafter.markov_bias(prev) if drafter.cfg.markov_rank else logits[k]
        conf.append(float(torch.softmax(row, -1).max()))
        prev = token
    return conf


def test_cutoff_ends_the_chain_before_the_first_unsure_slot(target, drafter):
    (ids,) = _prompts([30])
    session = spec_decode.TargetSession(target)
    _, hidden = session.prefill(ids)
    read = make_read("fold", drafter.cfg.rope, request=dict(prompt_len=30, max_new_tokens=8, block_size=8), window=8)
    proposer = BlockProposer(drafter, read, max_new_tokens=8, temperature=0.0, generator=None)
    proposer.start(session, ids, hidden)
    anchor = int(ids[-1])
    full, _ = drafter.draft(proposer.state, anchor, read)
    conf = _slot_confidence(drafter, proposer.state, anchor, read, full)
    assert len(full) >= 7 and len(set(conf)) > 1         # B - 1 slots (z-lab) or B (DSpark)
    # cutoffs between the slots' confidences (on a CPU a chain that may stop computes each slot's logits
    # alone, which can differ from the batched rows in the last bit, so no cutoff sits on one)
    levels = sorted(set(conf))
    for cutoff in [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [levels[0] / 2, 0.0, min(0.999, max(conf) * 1.01)]:
        want = next((k for k, c in enumerate(conf) if c < cutoff), len(full))
        assert drafter.draft(proposer.state, anchor, read, cutoff=cutoff)[0] == full[:want], cutoff
    for n in (1, 3, 7, 20):                          # 20: more than the block has
        assert drafter.draft(proposer.state, anchor, read, max_drafts=n)[0] == full[:n]


@pytest.mark.parametrize("policy", ["fold", "dflash"])
@pytest.mark.parametrize("draft_len, draft_cutoff", [(2, 0.0), (None, 0.02), (5, 0.02), (None, 0.999)])
def test_shorter_chains_are_lossless_at_batch_three(target, drafter, policy, draft_len, draft_cutoff):
    prompts = _prompts([40, 17, 29], seed=1)
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, policy=policy, window=8,
                           draft_len=draft_len, draft_cutoff=draft_cutoff)
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 20)
        assert torch.equal(result.sequences[b, :len(want)], want)
    per = result.stats["per_sequence"]
    drafted, rounds = sum(s["drafted_tokens"] for s in per), sum(s["rounds"] for s in per)
    assert drafted <= (draft_len or 8) * rounds
    if draft_cutoff == 0.999:                       # nothing is that sure: every round is a plain decoding step
        assert drafted == 0 and result.tau == 1.0 and rounds == 3 * 19


def test_glide_cutoff_is_lossless_and_drafts_less(target, tmp_path):
    glide = spec_decode.load_drafter(make_glide(tmp_path, target), target)
    prompts = _prompts([30, 12, 21], seed=3)
    ids, mask = padded_batch(prompts, "right")
    runs = {c: spec_decode.generate(target, glide, ids, attention_mask=mask, max_new_tokens=18, gamma=4, draft_cutoff=c)
            for c in (0.0, 0.5)}
    for result in runs.values():
        for b, p in enumerate(prompts):
            want = greedy_ar(target, p, 18)
            assert torch.equal(result.sequences[b, :len(want)], want)
    cut = runs[0.5].stats["per_sequence"]
    drafted, rounds = sum(s["drafted_tokens"] for s in cut), sum(s["rounds"] for s in cut)
    assert 0 < drafted < 4 * rounds                 # some chains end early, some do not
    with pytest.raises(ValueError, match="draft_len is a block drafter's"):
        spec_decode.generate(target, glide, ids[:1], max_new_tokens=3, draft_len=2)
