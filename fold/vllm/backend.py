"""A vLLM attention backend for a drafter's layers that reads its paged cache through ``fold.attention``.

The cache is vLLM's per-layer tensor, logically ``[num_blocks, heads_kv, block_size, 2 * head_dim]``
(keys then values in the last dim, in whatever physical layout vLLM resolved); read as pages
``[num_blocks, block_size, heads_kv, head_dim]`` for keys and values it is fold's paged layout, so
nothing depends on the CPU backend's ISA-specific packing. Keys are written rotated at their true
positions (vLLM rotates them before the write, and the DFlash context precompute rotates its keys at
the target positions); queries arrive rotated too. Every drafting round of DFlash/DSpark is a batch
of ``n_q = 1 + num_speculative_tokens`` query rows per request over ``seq_lens`` entries whose last
``n_q`` are the block's own: exactly ``fold.attention``'s layout.

Reads (the drafter config's ``fold`` block, :mod:`fold.vllm.config`):

- ``fold``: ``fold.attention(window=W, alpha)``;
- ``rerope``: ``fold.attention(far_position="fixed_distance", alpha=1)`` with ReRoPE's query scaling;
- ``window``: FOLD's window alone (row ``r`` sees ``j > n + r - D``), the ``W + 2 n_q`` newest
  entries gathered from the pages and read in one masked softmax.

Sliding-window drafter layers follow the paper's per-layer rules as ``fold.spec`` applies them
(:meth:`FoldAttentionImpl.attend_sliding`: the native window plus, for ``fold`` and ``rerope``, every
older entry as far memory), on the sequence gathered from the pages and un-rotated: correct on
any device, O(length) per call, not a kernel.

Attention sinks (``attention_sink_bias``) join as one more segment: a state of logit ``sink`` and
value 0, merged by mass. On CUDA the Triton kernels serve the ``fold`` and ``rerope`` reads; the
builder declares no CUDA-graph support, so these layers run eagerly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

import fold
from fold.masked import masked_attention
from fold.vllm.compat import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from fold.vllm.config import ServeRead

NAME = "FOLD"


class FoldAttentionBackend(AttentionBackend):
    """fold's read of a drafter layer over vLLM's paged cache (see the module docstring)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        return FoldAttentionImpl

    @staticmethod
    def get_builder_cls():
        return FoldMetadataBuilder

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class FoldMetadata:
    """One batch: ``num_reqs`` requests, ``query_start_loc [num_reqs + 1]``, ``seq_lens [num_reqs]``
    (entries per request, its queries' own included), ``block_table [num_reqs, max_blocks]`` int32."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool

    @property
    def uniform(self) -> bool:
        """Every request has ``max_query_len`` query rows (a drafting round)."""
        return self.num_reqs * self.max_query_len == self.num_actual_tokens


class FoldMetadataBuilder(AttentionMetadataBuilder[FoldMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FoldMetadata:
        cad = common_attn_metadata
        if isinstance(cad.causal, torch.Tensor):
            raise ValueError("fold's vLLM backend takes a causal flag per batch, not per request")
        return FoldMetadata(
            num_actual_tokens=cad.num_actual_tokens, num_reqs=cad.num_reqs, max_query_len=cad.max_query_len,
            query_start_loc=cad.query_start_loc, query_start_loc_cpu=cad.query_start_loc_cpu,
            seq_lens=cad.seq_lens.to(torch.int32), block_table=cad.block_table_tensor.to(torch.int32),
            slot_mapping=cad.slot_mapping, causal=bool(cad.causal))


def cache_pages(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache ``[num_blocks, heads_kv, block_size, 2 * head_size]`` -> key and value
    pages ``[num_blocks, block_size, heads_kv, head_size]`` each (views, no copy)."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


class FoldAttentionImpl(AttentionImpl[FoldMetadata]):
    """Args beyond vLLM's: ``read`` (:class:`ServeRead`), ``rope`` (the drafter's :class:`fold.Rope`, as
    vLLM rotates its queries and keys), ``sinks`` ([num_heads] logits or None)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, *, read: ServeRead,
                 rope: fold.Rope, sinks: torch.Tensor | None = None, kv_cache_dtype: str = "auto",
                 sliding_window: int | None = None, causal: bool = False):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.attn_type = AttentionType.DECODER
        self.read, self.rope, self.sinks = read, rope, sinks
        self.sliding_window, self.causal = sliding_window, causal

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: FoldMetadata | None, output,
                output_scale=None, output_block_scale=None):
        """``query [num_tokens, num_heads, head_size]`` (rotated at its positions) -> ``output`` of the
        same shape; the layer's keys and values are already in ``kv_cache`` (:meth:`do_kv_cache_update`)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fold's vLLM backend has no fused output quantization")
        if attn_metadata is None:                                            # profiling / warm-up
            return output
        if attn_metadata.causal and self.sliding_window is None:
            raise ValueError("fold's vLLM backend reads a bidirectional draft block on full-attention layers; this "
                             "batch asks for causal attention")
        meta, tokens = attn_metadata, attn_metadata.num_actual_tokens
        k_pages, v_pages = cache_pages(kv_cache, self.head_size)
        q, out = query[:tokens], output[:tokens]
        if meta.uniform:
            n_q = meta.max_query_len
            o = self.attend(q.view(meta.num_reqs, n_q, self.num_heads, self.head_size), k_pages, v_pages,
                            meta.seq_lens, meta.block_table)
            out.copy_(o.reshape(out.shape))
            return output
        starts = meta.query_start_loc_cpu.tolist()                           # a batch of unequal queries
        for b in range(meta.num_reqs):
            lo, hi = starts[b], starts[b + 1]
            if hi > lo:
                o = self.attend(q[lo:hi][None], k_pages, v_pages, meta.seq_lens[b:b + 1], meta.block_table[b:b + 1])
                out[lo:hi].copy_(o[0])
        return output

    def attend(self, q, k_pages, v_pages, seq_lens, block_table) -> torch.Tensor:
        """``q [batch, n_q, num_heads, head_size]`` over the pages -> ``[batch, n_q, num_heads, head_size]``."""
        read = self.read
        if self.sliding_window is not None:
            return torch.cat([self.attend_sliding(q[b:b + 1], k_pages, v_pages, int(length), block_table[b])
                              for b, length in enumerate(seq_lens.tolist())])
        if read.read == "window":
            o, lse = window_state(q, k_pages, v_pages, seq_lens, block_table, window=read.window, scale=self.scale)
        else:
            if read.read == "rerope":
                q = q * rerope_scale(seq_lens, q.shape[1], read.training_length)[:, :, None, None].to(q.dtype)
            o, lse = fold.attention(
                q, k_pages, v_pages, window=read.window, rope=self.rope,
                alpha=read.alpha if read.read == "fold" else 1.0, cache_seqlens=seq_lens, block_table=block_table,
                keys_rotated=True, queries_rotated=True, softmax_scale=self.scale, return_lse=True,
                far_position="shared" if read.read == "fold" else "fixed_distance")
        if self.sinks is not None:                       # a sink: one more entry of logit s_h and value 0
            total = torch.logaddexp(lse, self.sinks.to(lse.dtype)[None, None, :])
            o = (o.to(lse.dtype) * torch.exp(lse - total)[..., None]).to(q.dtype)
        return o

    def attend_sliding(self, q, k_pages, v_pages, length: int, table) -> torch.Tensor:
        """A sliding-window layer, one sequence (``q [1, n_q, Hq, d]``), by fold.spec's per-layer rules
        (paper Appendix B.3): ``fold`` keeps the native window and reads every older entry as far memory,
        ``rerope`` the same at distance ``D``, ``window`` is the native read. The sequence's entries are
        gathered from the pages and un-rotated (those rules take pre-RoPE keys): O(length) per call."""
        from fold.rope import rotate
        from fold.spec import policies

        n_q = q.shape[1]
        j = torch.arange(length, device=q.device)
        pages, offsets = table[j // k_pages.shape[1]].long(), j % k_pages.shape[1]
        undo = 1.0 / self.rope.attention_factor
        k = rotate(k_pages[pages, offsets].transpose(0, 1), -j, self.rope, factor=undo).transpose(0, 1)[None]
        v = v_pages[pages, offsets][None]
        q = rotate(q[0].transpose(0, 1), -j[length - n_q:], self.rope, factor=undo).transpose(0, 1)[None]
        kw = dict(rope=self.rope, sliding_window=self.sliding_window, causal=self.causal)
        if self.read.read == "window":
            return policies.sliding_state(q, k, v, **kw)[0]
        if self.read.read == "rerope":
            return policies.rerope_sliding_read(q, k, v, **kw, window=self.read.window,
                                                training_length=self.read.training_length, backend="torch")
        return policies.fold_sliding_read(q, k, v, **kw, window=self.read.window, alpha=self.read.alpha,
                                          backend="torch")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Write ``key, value [num_tokens, num_kv_heads, head_size]`` at ``slot_mapping`` (slot =
        page * block_size + offset; negative slots are padding)."""
        k_pages, v_pages = cache_pages(kv_cache, self.head_size)
        slots = slot_mapping.long()
        count = slots.shape[0]
        valid = slots >= 0
        slots = slots[valid]
        page, offset = slots // k_pages.shape[1], slots % k_pages.shape[1]
        k_pages[page, offset] = key[:count][valid].to(k_pages.dtype)
        v_pages[page, offset] = value[:count][valid].to(v_pages.dtype)


def rerope_scale(seq_lens: torch.Tensor, n_q: int, training_length: int) -> torch.Tensor:
    """ReRoPE's query scale ``max(1, log(p + 1) / log(training_length))`` at the rows' true positions
    ``p = seq_len - n_q + r``: ``[batch, n_q]`` float32."""
    p = seq_lens.to(torch.float64)[:, None] - n_q + torch.arange(n_q, device=seq_lens.device, dtype=torch.float64)
    return (torch.log(p + 1) / math.log(training_length)).clamp(min=1.0).to(torch.float32)


def window_state(q, k_pages, v_pages, seq_lens, block_table, *, window, scale):
    """FOLD's window alone over a paged cache of rotated keys, queries rotated at their positions: row
    ``r`` (at ``p = n + r``) sees entries ``j > p - D``, ``D = window + n_q``. Gathers the at most
    ``D + n_q - 1`` newest entries per sequence. Returns ``(o [batch, n_q, Hq, d] in q's dtype,
    lse [batch, n_q, Hq] float32)``."""
    batch, n_q, heads_q, head_dim = q.shape
    page_size = k_pages.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    d_pos = window + n_q
    outs, lses = [], []
    for b, length in enumerate(seq_lens.tolist()):
        n = length - n_q
        j = torch.arange(max(0, n - d_pos + 1), length, device=q.device)
        pages = block_table[b, j // page_size].long()
        k = k_pages[pages, j % page_size].transpose(0, 1).to(work)                     # [Hkv, N, d]
        v = v_pages[pages, j % page_size].transpose(0, 1).to(work)
        r = torch.arange(n_q, device=q.device)
        visible = j[None, :] > (n + r - d_pos)[:, None]                                 # [n_q, N]
        o, lse = masked_attention(q[b].transpose(0, 1).to(work), k, v, visible, scale)   # [Hq, n_q, d], [Hq, n_q]
        outs.append(o.transpose(0, 1).to(q.dtype))
        lses.append(lse.transpose(0, 1).to(torch.float32))
    return torch.stack(outs), torch.stack(lses)
