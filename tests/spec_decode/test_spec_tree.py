"""Tree verification: lossless against AR for chains and trees, batch > 1; tree construction."""

import copy

import pytest
import torch

from fold import spec_decode
from fold.spec_decode.tree import accept_path, build_tree, tree_mask
from tests.spec_decode_fixtures import greedy_ar, make_drafter, make_target, padded_batch


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    return make_target(request.param, tmp_path_factory.mktemp(f"target-{request.param}"))


@pytest.fixture(scope="module", params=["zlab", "dspark"])
def drafter(request, target, tmp_path_factory):
    path = make_drafter(tmp_path_factory.mktemp(request.param), target, request.param, block_size=5)
    return spec_decode.load_drafter(path, target)


@pytest.mark.parametrize("tree", [(1, 1, 1), (3, 2, 2), (4, 4, 2, 1)])
@pytest.mark.parametrize("policy", ["dflash", "fold"])
def test_tree_verification_is_lossless(target, drafter, tree, policy):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 90, (n,), generator=g) for n in (33, 18, 25)]
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16, policy=policy, window=8,
                           tree=tree)
    for b, p in enumerate(prompts):
        want = greedy_ar(target, p, 16)
        assert torch.equal(result.sequences[b, :len(want)], want)


def test_build_tree_keeps_the_best_paths_per_level():
    logits = torch.tensor([[0.0, 2.0, 1.0, -5.0], [3.0, 0.0, 0.0, 0.0]])
    tokens, parents, depths = build_tree(logits, (2, 3), anchor=9)
    assert tokens[:3] == [9, 1, 2] and parents[:3] == [-1, 0, 0]             # level 1: top-2 of slot 1
    assert depths == [0, 1, 1, 2, 2, 2]
    assert tokens[3:] == [0, 0, 1] and parents[3:] == [1, 2, 1]              # best cumulative paths


def test_tree_mask_and_greedy_path():
    parents = [-1, 0, 0, 1, 3]
    mask = tree_mask(parents)
    assert mask[4].tolist() == [True, True, False, True, True]
    tokens = [9, 5, 6, 7, 8]
    assert accept_path(tokens, parents, [5, 7, 0, 8, 3]) == ([1, 3, 4], 3)
    assert accept_path(tokens, parents, [6, 0, 2, 0, 0]) == ([2], 2)
    assert accept_path(tokens, parents, [1, 0, 0, 0, 0]) == ([], 1)


def test_tree_refuses_sampling(target, drafter):
    with pytest.raises(ValueError, match="tree verification is greedy"):
        spec_decode.generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=4, tree=(2, 2), temperature=1.0)


def test_tree_forward_gives_each_node_the_logits_of_its_own_path(target):
    """Inside tree_verification, node i's logits equal the target run on prompt + its root-to-node path;
    after compaction to one path the cache continues exactly like a fresh run."""
    from fold.spec_decode.tree import tree_verification

    target = copy.deepcopy(target).double()     # tree vs chain sum in different orders: compare in float64
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 90, (21,), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3]
    tokens = torch.randint(0, 90, (len(parents),), generator=g).tolist()
    depths = [0, 1, 1, 2, 2, 2, 3, 3]
    session = spec_decode.TargetSession(target)
    session.prefill(prompt)
    with torch.no_grad(), tree_verification(session, tree_mask(parents)[None]):
        logits, _ = session.verify(tokens, position_ids=torch.tensor(depths) + len(prompt))

    def path(i):
        return path(parents[i]) + [tokens[i]] if i >= 0 else []

    for i in range(len(parents)):
        full, _ = spec_decode.TargetSession(target).prefill(torch.cat([prompt, torch.tensor(path(i))]))
        torch.testing.assert_close(logits[i], full)
    kept = [0, 1, 4]                                                       # root, node 1, node 4
    session.keep_path(kept)
    nxt, _ = session.decode(5)
    committed = torch.cat([prompt, torch.tensor([tokens[k] for k in kept] + [5])])
    fresh, _ = spec_decode.TargetSession(target).prefill(committed)
    torch.testing.assert_close(nxt, fresh)
