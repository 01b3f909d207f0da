"""spec_decode.generate and spec_decode.autoregressive: every argument checked before any work; tau counts what was committed."""

import re

import pytest
import torch

from fold import spec_decode
from tests.spec_decode_fixtures import VOCAB, make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target("llama", tmp_path_factory.mktemp("t"))
    return target, spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp("d"), target, "zlab", block_size=8), target)


IDS = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
BAD = [
    # (override, error, words)
    (dict(input_ids=IDS[:, :0]), ValueError, "at least one prompt token per row"),
    (dict(input_ids=IDS[0]), ValueError, "input_ids must be a [batch, prompt_len] tensor"),
    (dict(input_ids=IDS.float()), TypeError, "input_ids must hold integer token ids"),
    (dict(input_ids=IDS + VOCAB), ValueError, f"input_ids must lie in [0, vocab_size={VOCAB})"),
    (dict(attention_mask=torch.ones(2, 5)), ValueError, "attention_mask must be a tensor of input_ids' shape"),
    (dict(attention_mask=torch.cat([torch.ones(1, 12), torch.zeros(1, 12)]).long()), ValueError,
     "attention_mask rows [1] are all zeros"),
    (dict(attention_mask=torch.full((2, 12), 2)), ValueError, "attention_mask must hold only 0"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int, got 0"),
    (dict(max_new_tokens=2.0), ValueError, "max_new_tokens must be a positive int"),
    (dict(temperature=-1), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0"),
    (dict(temperature="0"), ValueError, "temperature must be a finite number >= 0"),
    (dict(eos_token_id="\n"), TypeError, "eos_token_id must be an int or a list of ints"),
    (dict(eos_token_id=[1, "x"]), TypeError, "eos_token_id must be an int or a list of ints"),
    (dict(eos_token_id=VOCAB), ValueError, "eos_token_id [97] out of the vocabulary"),
    (dict(generator=0), TypeError, "generator must be a torch.Generator"),
]


@pytest.mark.parametrize("override, error, words", BAD, ids=[w[:40] for _, _, w in BAD])
@pytest.mark.parametrize("entry", ["generate", "autoregressive"])
def test_bad_arguments_fail_before_any_work(pair, monkeypatch, override, error, words, entry):
    target, drafter = pair
    calls = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1))   # no forward may run
    args = {**dict(input_ids=IDS, max_new_tokens=4), **override}
    with pytest.raises(error) as info:
        if entry == "generate":
            spec_decode.generate(target, drafter, window=8, **args)
        else:
            spec_decode.autoregressive(target, **args)
    assert words in str(info.value) and not calls


@pytest.mark.parametrize("override, error, words", [
    (dict(drafter="d"), TypeError, "drafter must come from fold.spec_decode.load_drafter"),
    (dict(target="t"), TypeError, "target must be a transformers causal LM"),
    (dict(progress=1), TypeError, "progress must be a bool"),
    (dict(tree=(2, True)), ValueError, "tree must be a non-empty tuple of positive ints"),
    (dict(tree=()), ValueError, "tree must be a non-empty tuple of positive ints"),
    (dict(draft_len=0), ValueError, "draft_len must be a positive int or None"),
    (dict(draft_len=True), ValueError, "draft_len must be a positive int or None"),
    (dict(draft_cutoff=1.0), ValueError, "draft_cutoff must be a number in [0, 1)"),
    (dict(draft_cutoff=float("nan")), ValueError, "draft_cutoff must be a number in [0, 1)"),
    (dict(draft_cutoff="0.5"), ValueError, "draft_cutoff must be a number in [0, 1)"),
    (dict(tree=(2, 2), draft_len=3), ValueError, "draft_len and draft_cutoff shape a chain"),
    (dict(tree=(2, 2), draft_cutoff=0.5), ValueError, "draft_len and draft_cutoff shape a chain"),
])
def test_generate_only_arguments(pair, override, error, words):
    target, drafter = pair
    args = {**dict(target=target, drafter=drafter, input_ids=IDS, max_new_tokens=4), **override}
    with pytest.raises(error, match=re.escape(words)):
        spec_decode.generate(args.pop("target"), args.pop("drafter"), **args)


def test_tau_counts_only_committed_tokens(pair):
    """A block of 8 drafts 7 tokens; with max_new_tokens=2 the one round commits one token, however
    many it accepted (the first token comes from the prefill)."""
    target, drafter = pair
    # a drafter that always agrees: take the target's own greedy continuation as the drafts
    ids = IDS[:1]
    want = spec_decode.autoregressive(target, ids, max_new_tokens=9).sequences[0, 12:].tolist()
    drafter_draft = drafter.draft
    drafter.draft = lambda state, anchor, read, temperature=0.0, generator=None, **_: (want[1:8], None)
    try:
        result = spec_decode.generate(target, drafter, ids, max_new_tokens=2, window=8)
    finally:
        drafter.draft = drafter_draft
    stats = result.stats["per_sequence"][0]
    assert stats["accepted_per_round"] == [8] and stats["committed_per_round"] == [1]
    assert result.tau == 1.0 and spec_decode.per_sequence_tau(result) == [1.0]
    assert result.sequences[0, 12:].tolist() == want[:2]


def test_autoregressive_tau_is_one(pair):
    target, _ = pair
    result = spec_decode.autoregressive(target, IDS, max_new_tokens=5)
    assert result.tau == 1.0 and [s["committed_per_round"] for s in result.stats["per_sequence"]] == [[1] * 4] * 2


def _other_target(**changes):
    """A tiny Llama that differs from the pair's target (4 layers, hidden 64, vocabulary 97) in ``changes``."""
    import transformers

    from tests.spec_decode_fixtures import target_config

    config = target_config("llama")
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("changes, words", [
    (dict(num_hidden_layers=2), "target_layer_ids [2] out of range for a target of 2 layers"),
    (dict(hidden_size=32), "drafter hidden_size=64 != target hidden_size=32"),
    (dict(vocab_size=95), "drafter vocab_size=97 != target vocab_size=95"),
])
def test_a_drafter_loaded_for_another_target_is_refused_before_any_work(pair, monkeypatch, changes, words):
    _, drafter = pair                                 # taps layers 0 and 2 of a 4-layer target
    other = _other_target(**changes)
    calls = []
    monkeypatch.setattr(other, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError) as info:
        spec_decode.generate(other, drafter, IDS, max_new_tokens=4, window=8)
    assert str(info.value) == f"the drafter does not fit this target (loaded for another?): {words}" + (
        " (output-of-layer ids in [-1, 0]; the last layer is never tapped)" if "layers" in words else "")
    assert not calls


def test_a_glide_drafter_loaded_for_another_target_is_refused(pair, tmp_path):
    from tests.spec_decode_fixtures import make_glide

    target, _ = pair
    glide = spec_decode.load_drafter(make_glide(tmp_path / "g", target), target)
    with pytest.raises(ValueError, match=r"must match the target's \(4, 16\); got \(2, 16\)"):
        spec_decode.generate(_other_target(num_key_value_heads=4), glide, IDS, max_new_tokens=4)
