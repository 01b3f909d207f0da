"""Tensor parallel 2 through vLLM 0.34's V2 ``DFlashSpeculator`` on a CPU: two processes, a gloo world.

Each rank (``harness.tp_rank``, spawned with ``torch.multiprocessing``) sets its process up as the
``v2_process`` fixture does, joins a two-rank gloo world with tensor parallel 2 and builds the
speculator with ``tensor_parallel_size=2``: vLLM's parallel layers shard the drafter (2 of the 4
query heads and 1 of the 2 KV heads per rank, the all-reduces over gloo), and fold's impl on each
rank reads its own heads over its own cache. Through :data:`SCHEDULE` (reading ``"fold"``, window
:data:`SMALL_W`: far memory on every call), every call of each rank is held to
``reference.fold_attention_ref`` (float64, the tolerance rule), and both ranks draft what one rank
(``tp=1``, this process) drafts.
"""

import pytest
import torch

from reference.tolerance import check_close
from tests.vllm.pair import TAPS
from tests.vllm_v2.harness import (SHORT_SCHEDULE, SMALL_W, K, Speculator, Target, fold_pair, free_port,
                                    recorded_rounds, tp_rank, truth)

TP = 2
SCHEDULE = SHORT_SCHEDULE


@pytest.fixture(scope="module")
def pair(v2_process, tmp_path_factory):
    return fold_pair(v2_process, tmp_path_factory.mktemp("v2-tp"))


@pytest.fixture(scope="module")
def one_rank(pair):
    return recorded_rounds(Speculator(pair["target"], pair["fold"]), Target(pair["target"], TAPS), SCHEDULE)


@pytest.fixture(scope="module")
def ranks(pair, tmp_path_factory):
    """``[rank 0's, rank 1's]`` results (``harness.tp_rank``)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("v2-tp-ranks")
    mp.spawn(tp_rank, args=(TP, free_port(), str(pair["target"]), str(pair["fold"]), SCHEDULE, str(out)), nprocs=TP,
             join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(TP)]


def test_each_rank_serves_its_share_of_the_heads_through_fold(ranks, one_rank):
    whole = {name: (layer.impl.num_heads, layer.impl.num_kv_heads)
             for name, layer in one_rank["speculator"].draft_layers.items()}
    assert set(whole.values()) == {(4, 2)}
    for rank in ranks:
        assert set(rank["heads"]) == set(whole)
        assert all(heads == (4 // TP, 2 // TP, "FoldAttentionImpl") for heads in rank["heads"].values())
        assert [c["layer"] for c in rank["calls"]] == [c["layer"] for c in one_rank["calls"]]
        assert all(c["q"].shape[1] == 4 // TP and c["k"].shape[-2] == 2 // TP for c in rank["calls"])


def test_every_call_of_each_rank_equals_the_reference(ranks):
    for r, rank in enumerate(ranks):
        far = 0
        for i, call in enumerate(rank["calls"]):
            for b, length in enumerate(call["seq_lens"]):
                assert not torch.isnan(call["k"][b, :length]).any() and not torch.isnan(call["v"][b, :length]).any()
                far += length - (K + 1) >= SMALL_W + K + 1
            check_close(f"rank {r} call {i} ({call['layer']})", call["out"], truth(call, True), truth(call, False),
                        torch.float32)
        assert far == sum(len(c["seq_lens"]) for c in rank["calls"])
    # the ranks read different heads: their queries and outputs are not the same
    assert not torch.allclose(ranks[0]["calls"][0]["out"], ranks[1]["calls"][0]["out"])


def test_both_ranks_draft_what_one_rank_drafts(ranks, one_rank):
    for r, rank in enumerate(ranks):
        for i, (ours, theirs) in enumerate(zip(rank["steps"], one_rank["steps"], strict=True)):
            assert ours["rows"] == theirs["rows"] and ours["context"] == theirs["context"]
            assert torch.equal(ours["drafts"], theirs["drafts"]), f"rank {r} step {i}"
