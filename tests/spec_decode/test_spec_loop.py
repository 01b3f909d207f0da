"""The speculative loop is lossless: greedy output equals the target's own, for every built policy."""

import pytest
import torch

from fold import spec_decode
from fold.spec_decode.policies import BUILT
from tests.spec_decode_fixtures import OPTIONS, greedy_ar, make_drafter, make_target, padded_batch


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    return make_target(request.param, tmp_path_factory.mktemp(f"target-{request.param}"))


@pytest.fixture(scope="module", params=["zlab", "deepspec-dflash", "dspark"])
def drafter(request, target, tmp_path_factory):
    return spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp(request.param), target, request.param), target)


# options that put every policy on its long-context path for 17-40-token prompts


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("policy", BUILT)
def test_lossless_batch_one(target, drafter, policy):
    (ids,) = _prompts([40])
    result = spec_decode.generate(target, drafter, ids[None], max_new_tokens=24, policy=policy, **OPTIONS[policy])
    assert torch.equal(result.sequences[0], greedy_ar(target, ids, 24))
    stats = result.stats["per_sequence"][0]                # the first token comes from the prefill
    assert result.tau * stats["rounds"] == pytest.approx(24 - 1) == sum(stats["committed_per_round"])


@pytest.mark.parametrize("policy", BUILT)
def test_lossless_batch_three_left_padded(target, drafter, policy):
    prompts = _prompts([40, 17, 29], seed=1)
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, policy=policy,
                           **OPTIONS[policy])
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 20)
        assert torch.equal(result.sequences[b, :len(want)], want)


def test_eos_stops_a_sequence_and_pads_it(target, drafter):
    (ids,) = _prompts([30], seed=2)
    full = greedy_ar(target, ids, 16)
    eos = int(full[len(ids) + 3])                         # the 4th generated token
    result = spec_decode.generate(target, drafter, ids[None], max_new_tokens=16, eos_token_id=eos, window=8)
    want = greedy_ar(target, ids, 16, eos=(eos,))
    assert torch.equal(result.sequences[0, :len(want)], want)
    assert (result.sequences[0, len(want):] == eos).all()


def test_shared_prefill_changes_no_token_and_runs_each_prompt_once(target, drafter):
    """``prefill=spec_decode.Prefills(target)``: the runs after the first start from a copy of the prompt's
    cache (one prompt forward each), and every sequence and round is the one a fresh prefill gives."""
    (p,) = _prompts([40])
    ids = torch.stack([p, p])                                       # a repeated row
    calls = []
    hook = target.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    try:
        shared = spec_decode.Prefills(target)
        runs = [spec_decode.generate(target, drafter, ids, max_new_tokens=12, policy=p, prefill=shared, window=8)
                for p in ("fold", "dflash")] + [spec_decode.autoregressive(target, ids, max_new_tokens=12, prefill=shared)]
    finally:
        hook.remove()
    assert sum(1 for n in calls if n == 40) == 1                    # one prompt forward for six sequences
    last_only = spec_decode.generate(target, drafter, ids, max_new_tokens=12, policy="fold", window=8,
                              prefill=spec_decode.Prefills(target, keep=1, last_logits_only=True))
    assert torch.equal(last_only.sequences, runs[0].sequences)
    fresh = [spec_decode.generate(target, drafter, ids, max_new_tokens=12, policy=p, window=8) for p in ("fold", "dflash")]
    fresh.append(spec_decode.autoregressive(target, ids, max_new_tokens=12))
    for got, want in zip(runs, fresh):
        assert torch.equal(got.sequences, want.sequences)
        assert [s["accepted_per_round"] for s in got.stats["per_sequence"]] == \
            [s["accepted_per_round"] for s in want.stats["per_sequence"]]


def test_shared_prefill_belongs_to_one_target(target, drafter):
    with pytest.raises(ValueError, match="prefill must be a fold.spec_decode.Prefills made for this target"):
        spec_decode.generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=2, prefill=spec_decode.Prefills(object()))
    with pytest.raises(ValueError, match="keep must be a positive int"):
        spec_decode.Prefills(target, keep=0)
