"""spec_decode.generate takes a user's read factory as ``policy``: the same protocol the named policies use."""

import pytest
import torch

import fold
from fold import spec_decode
from tests.spec_decode_fixtures import greedy_ar, make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target("qwen3", tmp_path_factory.mktemp("t"))
    return target, spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp("d"), target, "zlab", block_size=5), target)


IDS = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(3))


def test_a_factory_reproduces_the_named_policy_and_sees_each_request(pair):
    target, drafter = pair
    requests = []

    def factory(request):
        requests.append(request)
        return spec_decode.make_read("fold", request["rope"], request=request, window=8)

    ours = spec_decode.generate(target, drafter, IDS, max_new_tokens=12, policy=factory)
    named = spec_decode.generate(target, drafter, IDS, max_new_tokens=12, policy="fold", window=8)
    assert torch.equal(ours.sequences, named.sequences) and ours.tau == named.tau
    assert [r["prompt_len"] for r in requests] == [30, 30] and all(r["block_size"] == 5 for r in requests)
    assert all(r["rope"] is drafter.cfg.rope for r in requests)


def test_a_plain_function_read_with_an_after_verify_hook(pair):
    """A function read (wrapped in Read for sliding layers) is called for every layer of every round,
    and its after_verify hook after every verification; the output stays lossless."""
    target, drafter = pair
    calls = {"read": 0, "verify": 0}

    class Plain:
        def __call__(self, q, k, v, layer):
            calls["read"] += 1
            return fold.attention(q, k, v, window=k.shape[1], rope=drafter.cfg.rope, alpha=1.0)

        def after_verify(self, target, hidden_states, cache, committed, last_row):
            calls["verify"] += 1

    result = spec_decode.generate(target, drafter, IDS[:1], max_new_tokens=10, policy=lambda request: Plain())
    assert torch.equal(result.sequences[0], greedy_ar(target, IDS[0], 10))
    rounds = result.stats["per_sequence"][0]["rounds"]
    assert calls == {"read": rounds * drafter.cfg.num_layers, "verify": rounds}


@pytest.mark.parametrize("policy, options, error, words", [
    (42, {}, TypeError, "policy must be a policy name or a read factory"),
    (lambda request: None, {}, TypeError, "the policy factory must return a callable read"),
    (lambda request: spec_decode.Read(lambda *a: None), dict(window=8), ValueError, "apply to named policies only"),
])
def test_bad_custom_policies_are_refused(pair, policy, options, error, words):
    target, drafter = pair
    with pytest.raises(error, match=words):
        spec_decode.generate(target, drafter, IDS, max_new_tokens=4, policy=policy, **options)
