"""Metrics: τ, speedup, the paired bootstrap; the AR baseline."""

import pytest
import torch

from fold import spec_decode
from tests.spec_decode_fixtures import greedy_ar, make_drafter, make_target


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_data():
    g = torch.Generator().manual_seed(1)
    small = (torch.randn(20, generator=g) + 3).tolist()
    large = (torch.randn(2000, generator=g) + 3).tolist()
    m_small, lo_small, hi_small = spec_decode.bootstrap_ci([small])
    m_large, lo_large, hi_large = spec_decode.bootstrap_ci([large])
    assert lo_small < m_small < hi_small and lo_large < m_large < hi_large
    assert hi_large - lo_large < (hi_small - lo_small) / 4
    assert lo_large < 3 < hi_large
    assert spec_decode.bootstrap_ci([small]) == spec_decode.bootstrap_ci([small])          # fixed seed


def test_bootstrap_weights_tasks_equally():
    mean, low, high = spec_decode.bootstrap_ci([[1.0] * 100, [3.0] * 2])
    assert mean == pytest.approx(2.0) and low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_bootstrap_rejects_empty_groups():
    with pytest.raises(ValueError, match="at least one value"):
        spec_decode.bootstrap_ci([[1.0], []])


def test_autoregressive_is_the_targets_greedy_output_and_metrics_line_up(tmp_path):
    target = make_target("llama", tmp_path / "t")
    drafter = spec_decode.load_drafter(make_drafter(tmp_path / "d", target, "zlab"), target)
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(4))
    ar = spec_decode.autoregressive(target, ids, max_new_tokens=10)
    sd = spec_decode.generate(target, drafter, ids, max_new_tokens=10, window=8)
    assert torch.equal(ar.sequences, sd.sequences)
    assert torch.equal(ar.sequences[0], greedy_ar(target, ids[0], 10))
    for seq, stats, tau in zip(sd.sequences, sd.stats["per_sequence"], spec_decode.per_sequence_tau(sd)):
        # the first token comes from the prefill; every later one was committed by some round
        assert sum(stats["committed_per_round"]) == 10 - 1 and stats["rounds"] == len(stats["committed_per_round"])
        assert tau == 9 / stats["rounds"]
    assert sd.tau == 18 / sum(s["rounds"] for s in sd.stats["per_sequence"])
    assert spec_decode.per_sequence_tau(ar) == [1.0, 1.0]                        # one token per target forward


def test_tau_and_speedup_of_known_stats():
    result = spec_decode.GenerateResult(sequences=torch.zeros(2, 1), tau=0.0, stats=dict(per_sequence=[
        dict(committed_per_round=[3, 3, 1], rounds=3, tpot_s=0.5),
        dict(committed_per_round=[], rounds=0, tpot_s=0.25)]))             # stopped by the prefill's token
    ar = spec_decode.GenerateResult(sequences=torch.zeros(2, 1), tau=1.0, stats=dict(per_sequence=[
        dict(committed_per_round=[1] * 6, rounds=6, tpot_s=2.0), dict(committed_per_round=[], rounds=0, tpot_s=0.5)]))
    assert spec_decode.per_sequence_tau(result) == [7 / 3, 0.0]
    assert spec_decode.per_sequence_speedup(result, ar) == [4.0, 2.0]            # TPOT_AR / TPOT
    with pytest.raises(ValueError, match="same sequences, got 2 and 1"):
        spec_decode.per_sequence_speedup(result, spec_decode.GenerateResult(sequences=torch.zeros(1, 1), tau=1.0,
                                                              stats=dict(per_sequence=ar.stats["per_sequence"][:1])))
