"""Policy options are checked by name and range in ``make_read``, which ``spec_decode.generate`` calls before any work."""

import pytest
import torch

import fold
from fold import spec_decode
from fold.spec_decode.policies import OPTIONS, make_read
from tests.spec_decode_fixtures import make_drafter, make_target

ROPE = fold.Rope.from_theta(10000.0, 16)
REQUEST = dict(prompt_len=8, max_new_tokens=4, block_size=4)

BAD = [
    # (policy, options, error, words)
    ("window", dict(window=-5), ValueError, "window must be an int >= 0, got -5"),
    ("fold", dict(window=2.5), TypeError, "window must be an int >= 0, got 2.5"),
    ("fold", dict(window=True), TypeError, "window must be an int >= 0, got True"),
    ("fold", dict(alpha=0.5), ValueError, "alpha must be finite and in [1, 10000], got 0.5"),
    ("fold", dict(alpha=float("inf")), ValueError, "alpha must be finite and in [1, 10000]"),
    ("fold", dict(alpha=1e5), ValueError, "alpha must be finite and in [1, 10000]"),
    ("fold", dict(alpha="2"), TypeError, "alpha must be a real number"),
    ("fold", dict(backend="cuda"), ValueError, "backend must be one of ('auto', 'torch', 'triton'), got 'cuda'"),
    ("streaming", dict(sinks=-1), ValueError, "sinks must be an int >= 0, got -1"),
    ("streaming", dict(recent=-3), ValueError, "recent must be an int >= 0, got -3"),
    ("yarn", dict(reference_len=0), ValueError, "reference_len must be an int >= 1, got 0"),
    ("yarn", dict(rope_theta=0.5), ValueError, "rope_theta must be None or a finite number > 1"),
    ("rerope", dict(training_length=1), ValueError, "training_length must be an int >= 2, got 1"),
    ("infllm", dict(infllm_block=0), ValueError, "infllm_block must be an int >= 1, got 0"),
    ("infllm", dict(infllm_init=-1), ValueError, "infllm_init must be an int >= 0, got -1"),
    ("infllm", dict(infllm_topk=-1), ValueError, "infllm_topk must be an int >= 0, got -1"),
    ("infllm", dict(infllm_repr=0), ValueError, "infllm_repr must be an int >= 1, got 0"),
    ("cmr", dict(cmr_every=0), ValueError, "cmr_every must be an int >= 1, got 0"),
    ("cmr", dict(cmr_chunk=0), ValueError, "cmr_chunk must be an int >= 1, got 0"),
    ("cmr", dict(cmr_top=0), ValueError, "cmr_top must be an int >= 1, got 0"),
    ("fold", dict(windw=8), ValueError, "unknown policy options ['windw']"),
    ("dflash", dict(alpha=2.0, cmr_evry=3), ValueError, "unknown policy options ['cmr_evry']"),
    ("fold", dict(far_budget=0), ValueError, "far_budget must be None (every far entry) or an int >= 1, got 0"),
    ("fold", dict(far_budget=64.0), TypeError, "far_budget must be None (every far entry) or an int >= 1, got 64.0"),
    ("fold", dict(far_budget=True), TypeError, "far_budget must be None (every far entry) or an int >= 1, got True"),
    ("fold", dict(far_budget=64, far_page=0), ValueError, "far_page must be an int >= 1, got 0"),
    ("window", dict(far_budget=64), ValueError, "far_budget applies to policy='fold' only"),
    ("fold", dict(far_budget=64, far_rank="box"), ValueError, "far_rank must be one of ('bound', 'keys'), got 'box'"),
    ("fold", dict(far_budget=64, far_rank=1), TypeError, "far_rank must be one of ('bound', 'keys'), got 1"),
    # a block of 4 rows straddles up to 2 pages of 4: a budget of one page cannot hold them
    ("fold", dict(far_budget=7, far_page=4), ValueError, "far_budget must hold at least 2 pages of far_page=4 "
                                                          "entries for a block of 4 rows"),
]


@pytest.mark.parametrize("policy, options, error, words", BAD, ids=[w[:45] for *_, w in BAD])
def test_make_read_names_the_option_and_its_range(policy, options, error, words):
    with pytest.raises(error) as info:
        make_read(policy, ROPE, request=REQUEST, **options)
    assert words in str(info.value)


def test_every_default_is_valid_for_every_policy():
    from fold.spec_decode.policies import BUILT

    for policy in BUILT:
        assert callable(make_read(policy, ROPE, request=REQUEST, **OPTIONS))


@pytest.mark.parametrize("request_, words", [(None, "request must be dict"), (dict(prompt_len=0, max_new_tokens=1,
                                                                                     block_size=1), "prompt_len")])
def test_yarn_needs_a_valid_request(request_, words):
    with pytest.raises(ValueError, match=words):
        make_read("yarn", ROPE, request=request_)


@pytest.mark.parametrize("policy, options, error, words", [BAD[0], BAD[3], BAD[13], BAD[17], BAD[20], BAD[-1]])
def test_generate_checks_the_options_before_any_forward(tmp_path, monkeypatch, policy, options, error, words):
    target = make_target("llama", tmp_path / "t")
    drafter = spec_decode.load_drafter(make_drafter(tmp_path / "d", target, "zlab"), target)
    calls = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(error) as info:
        spec_decode.generate(target, drafter, torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, policy=policy, **options)
    assert words in str(info.value) and not calls


def test_generate_documents_every_policy_option():
    """generate's docstring names every option make_read takes (it once left one out)."""
    from fold.spec_decode import generate

    doc = generate.__doc__
    missing = [name for name in OPTIONS if f"``{name}``" not in doc]
    assert missing == []
