"""LongSpec's GLIDE drafter: loading, and lossless chain drafting against the target's own output."""

import copy
import json

import pytest
import torch

from fold import spec_decode
from fold.spec_decode.glide import GlideDrafter
from tests.spec_decode_fixtures import greedy_ar, make_glide, make_target, padded_batch


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    return make_target(request.param, tmp_path_factory.mktemp(f"target-{request.param}"))


@pytest.fixture(scope="module")
def glide(target, tmp_path_factory):
    return spec_decode.load_drafter(make_glide(tmp_path_factory.mktemp("glide"), target, window=6), target)


def test_loads_as_glide(glide):
    assert isinstance(glide, GlideDrafter) and glide.cfg.window == 6
    assert glide.self_attn.q_proj.bias is not None and glide.self_attn.o_proj.bias is None


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_glide_chain_is_lossless_at_batch_three(target, glide, gamma):
    g = torch.Generator().manual_seed(gamma)
    prompts = [torch.randint(0, 90, (n,), generator=g) for n in (30, 12, 21)]
    ids, mask = padded_batch(prompts, "right")                         # right padding this time
    result = spec_decode.generate(target, glide, ids, attention_mask=mask, max_new_tokens=18, gamma=gamma)
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 18)
        assert torch.equal(result.sequences[b, :len(want)], want)


def test_glide_refuses_policies(target, glide):
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="context policies do not apply"):
        spec_decode.generate(target, glide, ids, max_new_tokens=3, policy="fold")


@pytest.mark.parametrize("tree", [(1, 1, 1), (4, 3, 2), (2, 4, 4, 4)])
def test_glide_tree_is_lossless_at_batch_three(target, glide, tree):
    g = torch.Generator().manual_seed(len(tree))
    prompts = [torch.randint(0, 90, (n,), generator=g) for n in (26, 9, 17)]
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, glide, ids, attention_mask=mask, max_new_tokens=16, tree=tree)
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 16)
        assert torch.equal(result.sequences[b, :len(want)], want)


def test_glide_tree_nodes_see_exactly_their_ancestors(target, glide):
    """A node's draft logits in the tree equal feeding its root-to-node path as a chain.

    Both run in float64: the tree and the chain sum in different orders, and in float32 how far
    apart that leaves them depends on the CPU and the thread count."""
    from fold.spec_decode.glide import glide_tree

    target, glide = copy.deepcopy(target).double(), copy.deepcopy(glide).double()
    glide.bind(target)

    prompt = torch.randint(0, 90, (14,), generator=torch.Generator().manual_seed(2))
    session = spec_decode.TargetSession(target)
    session.prefill(prompt)
    cache = session.cache
    state = glide.new_state(64)
    root = glide.forward_tokens(state, prompt, cache)[-1]
    tokens, parents, depths, node_logits = glide_tree(glide, state, root, int(prompt[-1]), (3, 2, 2), cache)
    assert sorted(node_logits) == [i for i, d in enumerate(depths) if d <= 2]
    for node in [i for i, d in enumerate(depths) if d in (1, 2)]:
        chain_state = glide.new_state(64)
        glide.forward_tokens(chain_state, prompt, cache)
        path, a = [], node
        while a > 0:
            path.insert(0, tokens[a])
            a = parents[a]
        chain_logits = glide.forward_tokens(chain_state, torch.tensor(path), cache)[-1]
        torch.testing.assert_close(node_logits[node], chain_logits)


def test_glide_must_match_the_targets_kv_heads(tmp_path, target):
    path = make_glide(tmp_path / "g", target)
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size=32 != target hidden_size=64"):
        spec_decode.load_drafter(path, target)


def test_glide_drafts_change_with_its_context(target, glide):
    """The cross-attention really reads the target's cache: a different prefix changes the draft logits."""
    logits = []
    for prefix in ([5, 6, 7, 8, 9, 10], [50, 60, 70, 80, 9, 10]):
        ids = torch.tensor(prefix)
        session = spec_decode.TargetSession(target)
        session.prefill(ids)
        cache = session.cache
        state = glide.new_state(16)
        logits.append(glide.forward_tokens(state, ids, cache)[-1])
    assert not torch.allclose(logits[0], logits[1])
