"""FOLD inside z-lab's own loop: ``fold.spec_decode.use_fold(drafter)`` on an upstream drafter makes
``dflash_generate`` draft exactly as ``fold.spec_decode.generate(..., policy="fold", tail="shrink")`` does,
round by round, past the drafter's training length and past a sliding layer's window; the target's
attention is untouched, and ``remove()`` restores the stock read.
"""

import pytest
import torch
import transformers

from fold import spec_decode
from tests.spec_decode_fixtures import DRAFTER_WINDOW, greedy_ar, make_drafter, make_target
from tests.upstream_fixtures import KINDS, import_upstream, make_kind, run_fold, run_upstream, upstream_drafter

upstream = import_upstream()
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

VOCAB, TRAINED = 16, 32               # the drafters' max_position_embeddings: the length they "trained" at
PROMPT, NEW, WINDOW = 48, 30, 8       # prompts past it; FOLD's window far shorter, so far memory is read


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target("qwen3", tmp_path_factory.mktemp("target"), vocab=VOCAB).to(torch.float64)


SLIDING = [kind for kind in KINDS if kind.endswith("sliding")]
ONE_PER_FAMILY = [kind for kind in KINDS if kind.endswith("-causal-sliding")]     # the hook, not the drafter


@pytest.fixture(scope="module")
def pairs(target, tmp_path_factory):
    """``pairs(kind) -> (fold's drafter, upstream's drafter)`` of one checkpoint, written once per kind."""
    made = {}

    def pair(kind):
        if kind not in made:
            path = make_kind(kind, tmp_path_factory.mktemp(kind), target, max_position_embeddings=TRAINED)
            made[kind] = spec_decode.load_drafter(path, target), upstream_drafter(upstream, path)
        return made[kind]
    return pair


@pytest.fixture(scope="module")
def prompt():
    assert PROMPT > max(TRAINED, WINDOW + DRAFTER_WINDOW)
    return torch.randint(0, VOCAB - 1, (1, PROMPT), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kind", KINDS)
def test_upstream_loop_with_fold_equals_policy_fold_round_by_round(target, pairs, kind, prompt, monkeypatch):
    ours, theirs = pairs(kind)
    stock = run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    with spec_decode.use_fold(theirs, window=WINDOW, alpha=2.0):
        ids, committed, rounds = run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    want_ids, want_committed, _, want_rounds = run_fold(target, ours, prompt, NEW, policy="fold", window=WINDOW,
                                                        tail="shrink")
    assert rounds == want_rounds and committed == want_committed
    assert torch.equal(ids, want_ids) and torch.equal(ids[0], greedy_ar(target, prompt[0], NEW))      # lossless
    assert sum(a != b for a, b in zip(rounds, stock[2])) >= len(rounds) // 2          # FOLD's drafts, not stock's


@pytest.mark.parametrize("kind", SLIDING)
def test_sliding_layers_keep_every_entry_while_fold_reads(target, pairs, kind, prompt, monkeypatch):
    """Upstream's draft cache keeps a sliding layer's last ``sliding_window - 1`` entries; while FOLD reads,
    every layer keeps every entry, the far memory FOLD reads beyond the layer's own window."""
    _, theirs = pairs(kind)
    made, make = [], upstream._make_cache
    monkeypatch.setattr(upstream, "_make_cache", lambda config: made.append(make(config)) or made[-1])
    run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    with spec_decode.use_fold(theirs, window=WINDOW):
        run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    (_, stock), (_, folded) = made[:2], made[2:]                          # (target's, drafter's) per run
    windows = [layer.self_attn.sliding_window for layer in theirs.layers]
    assert set(windows) <= {None, DRAFTER_WINDOW} and PROMPT > DRAFTER_WINDOW
    held = [[layer.keys.shape[-2] for layer in cache.layers] for cache in (stock, folded)]
    length = folded.get_seq_length()
    assert length > PROMPT and held[1] == [length] * len(windows)
    assert held[0] == [length if w is None else min(length, w - 1) for w in windows]


@pytest.mark.parametrize("kind", ONE_PER_FAMILY)
def test_target_untouched_and_remove_restores(target, pairs, kind, prompt, monkeypatch):
    ours, theirs = pairs(kind)
    registry = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    sdpa, config = registry["sdpa"], theirs.config
    with torch.no_grad():
        before = target(prompt).logits
    handle = spec_decode.use_fold(theirs, window=WINDOW)
    try:
        with torch.no_grad():
            during = target(prompt).logits
            run_upstream(upstream, theirs, target, prompt, 4, monkeypatch)
            after_a_run = target(prompt).logits
        assert torch.equal(before, during) and torch.equal(before, after_a_run)            # bit-identical
        assert registry["sdpa"] is sdpa and transformers.models.qwen3.modeling_qwen3.ALL_ATTENTION_FUNCTIONS is registry
        assert theirs.config is not config and set(theirs.config.layer_types) == {"full_attention"}
    finally:
        handle.remove()
    handle.remove()                                                                       # a second call: nothing
    assert theirs.config is config and upstream.ALL_ATTENTION_FUNCTIONS is registry
    _, _, rounds = run_upstream(upstream, theirs, target, prompt, NEW, monkeypatch)
    _, _, _, stock = run_fold(target, ours, prompt, NEW, policy="dflash", tail="shrink")
    assert rounds == stock                                                                # the stock read again


@pytest.mark.parametrize("kind", ONE_PER_FAMILY)
def test_only_the_hooked_drafter_reads_with_fold(target, pairs, kind, prompt, tmp_path, monkeypatch):
    ours, theirs = pairs(kind)
    other = upstream_drafter(upstream, make_drafter(tmp_path / "other", target, "zlab", seed=3))
    stock = run_upstream(upstream, other, target, prompt, NEW, monkeypatch)
    with spec_decode.use_fold(theirs, window=WINDOW):
        assert run_upstream(upstream, other, target, prompt, NEW, monkeypatch)[2] == stock[2]
        with pytest.raises(ValueError, match="already reads with FOLD"):
            spec_decode.use_fold(theirs, window=WINDOW)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=-1), ValueError, "window must be an int >= 0"),
    (dict(window=2.5), TypeError, "window must be an int"),
    (dict(alpha=0.5), ValueError, "alpha must be finite and in"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
])
@pytest.mark.parametrize("kind", ONE_PER_FAMILY[:1])
def test_bad_options_are_refused_by_name(pairs, kind, kwargs, error, match):
    _, theirs = pairs(kind)
    config = theirs.config
    with pytest.raises(error, match=match):
        spec_decode.use_fold(theirs, **kwargs)
    assert theirs.config is config
    assert upstream.ALL_ATTENTION_FUNCTIONS is transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS


@pytest.mark.parametrize("kind", ONE_PER_FAMILY)
def test_a_drafter_that_is_not_upstreams_is_refused(pairs, kind):
    ours, _ = pairs(kind)
    with pytest.raises(TypeError, match="upstream DFlash"):
        spec_decode.use_fold(ours)
    with pytest.raises(TypeError, match="upstream DFlash drafter"):
        spec_decode.use_fold(torch.nn.Linear(2, 2))
