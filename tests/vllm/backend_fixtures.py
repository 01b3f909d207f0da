"""The pieces the backend's tests share: a drafting batch as vLLM hands it over, its pages and slots,
a backend instance and its layer (no engine)."""

from types import SimpleNamespace

import torch

import fold
from fold.vllm import compat
from fold.vllm.backend import FoldAttentionImpl
from reference import apply_rope

HQ, HKV, D, PAGE, BLOCKS = 4, 2, 64, 16, 24
ROPE = fold.Rope.from_theta(1e4, D)


def make_batch(seq_lens, n_q, seed=0, dtype=torch.float32):
    """A drafting batch as vLLM hands it over: the pages (cache tensor [blocks, Hkv, page, 2d]), the
    metadata, rotated queries, and the dense truth of each sequence's keys and values."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_blocks = -(-max(seq_lens) // PAGE)
    order = torch.randperm(BLOCKS - 1, generator=g)[:batch * max_blocks] + 1       # page 0: vLLM's null block
    table = order.view(batch, max_blocks).to(torch.int32)
    keys = [torch.randn(n, HKV, D, generator=g) for n in seq_lens]
    values = [torch.randn(n, HKV, D, generator=g) for n in seq_lens]
    keys = [apply_rope(k, torch.arange(len(k))[:, None], ROPE.inv_freq, rotary_dim=D) for k in keys]
    q = torch.randn(batch * n_q, HQ, D, generator=g)
    positions = torch.cat([torch.arange(n - n_q, n) for n in seq_lens])
    q = apply_rope(q, positions[:, None], ROPE.inv_freq, rotary_dim=D).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    cad = compat.CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * n_q,
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32) * n_q, seq_lens=seq, num_reqs=batch,
        num_actual_tokens=batch * n_q, max_query_len=n_q, max_seq_len=max(seq_lens), block_table_tensor=table,
        slot_mapping=torch.zeros(batch * n_q, dtype=torch.int64), causal=False)
    return q, keys, values, cad


def slots_of(table, lengths):
    """Slot of every entry ``j < length`` of each sequence, in order (page * PAGE + offset)."""
    return torch.cat([table[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
                      for b, n in enumerate(lengths)])


def make_impl(read, dtype="auto", sliding=None, causal=False, sinks=None):
    return FoldAttentionImpl(HQ, D, D ** -0.5, HKV, read=read, rope=ROPE, kv_cache_dtype=dtype,
                             sliding_window=sliding, causal=causal, sinks=sinks)


def fake_layer(k_scale=1.0, v_scale=1.0):
    return SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=v_scale, layer_name="model.layers.0.self_attn.attn")


def positions_of(keys):
    """The positions of every entry of each sequence, in order (each sequence from 0)."""
    return torch.cat([torch.arange(len(k)) for k in keys])


def write_all(impl, layer, kv_cache, keys, values, table):
    """The keys and values written through do_kv_cache_update as the DFlash context precompute does (its
    positions handed around the call, as fold.vllm.models.hand_context_positions does), with padding slots."""
    slots = slots_of(table, [len(k) for k in keys])
    pad = torch.full((5,), -1, dtype=torch.int64)
    key, value = torch.cat(keys), torch.cat(values)
    impl.context_positions = torch.cat([positions_of(keys), torch.zeros(5, dtype=torch.int64)])
    try:
        impl.do_kv_cache_update(layer, torch.cat([key, key[:5]]), torch.cat([value, value[:5]]), kv_cache,
                                torch.cat([slots, pad]))
    finally:
        impl.context_positions = None


def empty_cache(dtype):
    return torch.full((BLOCKS, HKV, PAGE, 2 * D), 0, dtype=torch.uint8) if dtype.startswith("fp8") else \
        torch.full((BLOCKS, HKV, PAGE, 2 * D), float("nan"), dtype=torch.float32)
