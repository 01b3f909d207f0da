"""examples/inspect_real_features.py: the lag probe and the copy split, on data whose answers are known."""

from types import SimpleNamespace

import torch

from examples import inspect_real_features as inspect_features


def test_lag_probe_reads_exactly_the_lags_the_features_hold():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(50, 16, generator=g)
    ids = torch.randint(0, 50, (40, 30), generator=g)
    prev = torch.cat([torch.zeros(40, 1, 16), embed[ids[:, :-1]]], 1)            # the token before, 0 at t = 0
    feats = torch.cat([embed[ids], prev], -1) + 0.01 * torch.randn(40, 30, 32, generator=g)
    acc = inspect_features.lag_probe(feats, ids, embed, [0, 1, 2, 3], train_rows=30)
    assert acc[0] > 0.95 and acc[1] > 0.95                  # what the features hold
    assert acc[2] < 0.3 and acc[3] < 0.3                    # what they do not (chance is 1/50)


def test_layer_probe_scores_each_hidden_state_alone():
    """A fake target whose hidden states hold the token (0), the token before (1) and nothing (2)."""
    g = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(50, 16)
    torch.nn.init.normal_(embed.weight, generator=g)
    ids = torch.randint(0, 50, (40, 30), generator=g)

    class Fake(torch.nn.Module):
        def get_input_embeddings(self):
            return embed

        def forward(self, x, output_hidden_states):
            e = embed(x)
            prev = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], 1)
            return SimpleNamespace(hidden_states=(e, prev, torch.randn(e.shape, generator=g)))

    res = inspect_features.layer_probe(Fake(), ids, [0, 1], train_rows=30, batch=7)
    assert len(res) == 3
    assert res[0][0] > 0.95 and res[0][1] < 0.3
    assert res[1][1] > 0.95 and res[1][0] < 0.3
    assert res[2][0] < 0.3 and res[2][1] < 0.3


def test_copy_accuracy_splits_slots_by_copy_run(monkeypatch):
    """A fake drafter right exactly on copied tokens: copies score 1, the rest 0, every slot counted once."""
    torch.manual_seed(0)
    n, t, bs = 3, 64, 4
    ids = torch.randint(0, 20, (n, t))
    greedy = torch.randint(0, 20, (n, t))
    copy = torch.rand(n, t) < 0.4
    copy[:, 30:40] = True                                    # one long run per row

    def fake_block_logits(drafter, features, ids_b, anchors, positions):
        b = int(features[0, 0, 0])                           # the row, smuggled in the features
        cols = anchors[0][:, None] + torch.arange(bs - 1)
        tokens = torch.where(copy[b][cols + 1], greedy[b][cols], (greedy[b][cols] + 1) % 20)
        return torch.nn.functional.one_hot(tokens, 20).float()[None]

    monkeypatch.setattr(inspect_features, "block_logits", fake_block_logits)
    feats = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, t, 2)
    res = inspect_features.copy_accuracy(SimpleNamespace(cfg=SimpleNamespace(block_size=bs)), feats, ids, greedy, copy,
                                         stride=5, min_context=8)
    anchors = range(8, t - bs, 5)
    blocks = len(anchors)
    # slot i of block a scores the token at a + i + 1: "long" when it and the 3 before it are copies
    long_slots = sum(bool(copy[b, a + i - 2:a + i + 2].all()) for b in range(n) for a in anchors for i in range(bs - 1))
    assert res["long_copy"][1] == long_slots > 0
    assert res["long_copy"][0] == res["long_copy"][1] and res["short_copy"][0] == res["short_copy"][1] > 0
    assert res["no_copy"][0] == 0 < res["no_copy"][1]
    total = res["long_copy"][1] + res["short_copy"][1] + res["no_copy"][1]
    assert total == n * blocks * (bs - 1) == sum(c for _, c in res["slots"])
