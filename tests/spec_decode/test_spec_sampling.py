"""Temperature > 0: speculative sampling keeps the target's distribution (rejection sampling)."""

import itertools

import pytest
import torch

from fold import spec_decode
from tests.spec_decode_fixtures import SAMPLING_VOCAB as VOCAB
from tests.spec_decode_fixtures import assert_follows, make_drafter, make_target

TEMPERATURE = 1.5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target("qwen3", tmp_path_factory.mktemp("t8"), vocab=VOCAB, seed=3)
    drafter = spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp("d8"), target, "dspark", block_size=3), target)
    return target, drafter


@torch.no_grad()
def _exact_marginals(target, prompt, steps):
    """P(x_t) of generated tokens t = 1..steps under the target at TEMPERATURE, by enumeration."""
    def dist(prefix):
        logits, _ = spec_decode.TargetSession(target).prefill(torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)]))
        return torch.softmax(logits.double() / TEMPERATURE, -1)

    marginals = [torch.zeros(VOCAB, dtype=torch.float64) for _ in range(steps)]
    for prefix_len in range(steps):
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            weight = 1.0
            for t in range(prefix_len):
                weight *= float(dist(list(prefix[:t]))[prefix[t]])
            marginals[prefix_len] += weight * dist(list(prefix))
    return marginals


@pytest.mark.parametrize("draft_cutoff", [0.0, 0.3])        # 0.3: some chains end early (checked below)
def test_generated_tokens_follow_the_targets_distribution(pair, draft_cutoff):
    target, drafter = pair
    prompt = torch.tensor([1, 5, 2, 6, 3, 0, 4, 2, 5, 1, 6, 3])
    steps, samples = 3, 600
    exact = _exact_marginals(target, prompt, steps)
    g = torch.Generator().manual_seed(0)
    result = spec_decode.generate(target, drafter, prompt.repeat(samples, 1), max_new_tokens=steps, policy="fold",
                           window=4, temperature=TEMPERATURE, generator=g, draft_cutoff=draft_cutoff)
    generated = result.sequences[:, len(prompt):]
    drafted = sum(s["drafted_tokens"] for s in result.stats["per_sequence"])
    accepted = sum(sum(r - 1 for r in s["accepted_per_round"]) for s in result.stats["per_sequence"])
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    rounds = sum(s["rounds"] for s in result.stats["per_sequence"])
    if draft_cutoff:
        assert drafted < drafter.cfg.block_size * rounds, "the cutoff must end some chains early"
    for t in range(1, steps):                                   # tokens that went through verification
        counts = torch.bincount(generated[:, t], minlength=VOCAB).double()
        assert_follows(counts, exact[t] * samples, f"token {t}: ")


def test_sampling_is_reproducible_with_a_generator(pair):
    target, drafter = pair
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    runs = [spec_decode.generate(target, drafter, prompt, max_new_tokens=6, temperature=1.0, window=4,
                          generator=torch.Generator().manual_seed(5)).sequences for _ in range(2)]
    assert torch.equal(*runs)
