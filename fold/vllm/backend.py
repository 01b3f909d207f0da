"""A vLLM attention backend for a drafter's layers that reads its paged cache through ``fold.attention``.

The cache is vLLM's per-layer tensor, logically ``[num_blocks, heads_kv, block_size, 2 * head_dim]``
(keys then values in the last dim, in whatever physical layout vLLM resolved); read as pages
``[num_blocks, block_size, heads_kv, head_dim]`` for keys and values it is fold's paged layout, so
nothing depends on the CPU backend's ISA-specific packing. **The cache holds keys un-rotated**, the
layout FOLD's far memory reads: vLLM hands each key rotated at its true position (the DFlash context
precompute at the target positions, the drafting forward at the block's), and fold un-rotates it once,
as it writes it (:meth:`~FoldAttentionImpl.write`), so a round rotates only what it must (its window's
entries and its block's rows, ``fold.attention(..., keys_rotated=False)``), never the far memory.
Queries arrive rotated. Every drafting round of DFlash/DSpark is a batch of ``n_q`` query rows per
request over ``seq_lens`` entries whose last ``n_q`` are the block's own: exactly ``fold.attention``'s
layout. The positions of a write: the precompute's are handed to fold around the call
(:func:`fold.vllm.models.hand_context_positions`); the forward's block rows sit at ``seq_len - n_q + r``
of their request (``forward_includes_kv_cache_update``: vLLM hands the block's keys to ``forward``,
where the metadata gives those positions).

Every read is one ``fold.attention`` call over the pages (the drafter config's ``fold`` block,
:mod:`fold.vllm.config`):

- ``fold``: window ``W`` at exact positions, far memory at the shared position, ``alpha``;
- ``rerope``: ``far_position="fixed_distance"``, ``alpha=1``, ReRoPE's query scaling;
- ``window``: ``far_position="none"``, FOLD's window alone (row ``r`` sees ``j > n + r - D``).

With ``"far_budget"`` (``fold`` only) the far branch reads at most ``far_budget // block_size`` pages
per request and KV head, chosen by per-page bounds of the un-rotated keys: one ``[num_blocks, heads_kv,
2, head_size]`` float32 tensor per layer beside its cache (indexed by physical block, allocated from the
cache's shape on first use), updated in :meth:`~FoldAttentionImpl.write` as entries are
written (a write at a page's offset 0 starts its box afresh, as engines reuse pages).

A sliding-window layer passes its window (``sliding_window``, the paper's per-layer rule: the native
window is the local branch, every older entry far memory for ``fold`` and ``rerope``; ``window`` is
its native read) and its causality (the layer's own flag, not the batch's). Attention sinks
(``attention_sink_bias``) join as one more segment: a state of logit ``sink`` and value 0, merged
by mass. An FP8 cache (``kv_cache_dtype`` ``fp8``/``fp8_e4m3``/``fp8_e5m2``) holds ``k / k_scale``,
``v / v_scale`` with the layer's scales; it is written quantized and read dequantized on load.

Drafting batches (every request ``n_q`` rows) are CUDA-graph safe: ``build`` and ``forward`` read no
tensor on the host, page writes are a scatter over ``slot_mapping`` (padding slots rewrite slot 0 with
what it holds), and the builder declares :attr:`~AttentionCGSupport.UNIFORM_BATCH`. Other batches
(rows per request unequal) are read request by request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import fold
from fold.rope import rerope_scale, rotate
from fold.vllm.compat import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from fold.vllm.config import ServeRead

NAME = "FOLD"
# vLLM's kv_cache_dtype -> the dtype fold reads the cache in (None: the model's); FP8 caches are uint8 tensors
CACHE_DTYPES = {"auto": None, "bfloat16": None, "float16": None, "float32": None, "fp8": torch.float8_e4m3fn,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FAR_POSITION = {"fold": "shared", "rerope": "fixed_distance", "window": "none"}


class FoldAttentionBackend(AttentionBackend):
    """fold's read of a drafter layer over vLLM's paged cache (see the module docstring)."""

    # forward writes the block's own keys and values: its metadata gives their positions, to un-rotate them
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)

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
    (entries per request, its queries' own included; 0 for a CUDA graph's padding requests),
    ``block_table [num_reqs, max_blocks]`` int32. The tensors are the builder's inputs themselves
    (vLLM's persistent buffers), never copies, so a captured graph reads this step's values."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor    # the batch's flag, as vLLM passed it (DFlash checks it); each layer reads by its own

    @property
    def uniform(self) -> bool:
        """Every request has ``max_query_len`` query rows (a drafting round)."""
        return self.num_reqs * self.max_query_len == self.num_actual_tokens


class FoldMetadataBuilder(AttentionMetadataBuilder[FoldMetadata]):
    """Metadata for fold's read: references to vLLM's buffers, no host reads (capture safe)."""

    # drafting batches are uniform (n_q rows per request): V2 captures the draft step in a graph
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # the metadata references the persistent buffers V2 updates in place, so nothing needs refreshing
    supports_draft_decode_metadata_update: bool = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FoldMetadata:
        cad = common_attn_metadata
        table = cad.block_table_tensor
        return FoldMetadata(
            num_actual_tokens=cad.num_actual_tokens, num_reqs=cad.num_reqs, max_query_len=cad.max_query_len,
            query_start_loc=cad.query_start_loc, query_start_loc_cpu=cad.query_start_loc_cpu,
            seq_lens=cad.seq_lens, block_table=table if table.dtype == torch.int32 else table.to(torch.int32),
            slot_mapping=cad.slot_mapping, causal=cad.causal)

    def update_draft_decode_metadata(self, metadata: FoldMetadata) -> None:
        """Nothing to do: ``metadata`` holds the buffers V2 rewrites in place for each draft step."""


def block_positions(meta: FoldMetadata, tokens: int) -> torch.Tensor:
    """``[tokens]`` the positions of a forward's query tokens: token ``t`` of request ``b`` (its rows
    ``query_start_loc[b] ..``) sits at ``seq_lens[b] - q_len_b + (t - query_start_loc[b])`` (a block's rows
    are the last entries of their request). Device ops on fixed shapes: no host read, capture safe."""
    starts = meta.query_start_loc
    t = torch.arange(tokens, device=starts.device, dtype=starts.dtype)
    req = torch.searchsorted(starts[1:meta.num_reqs + 1], t, right=True).clamp(max=max(meta.num_reqs - 1, 0))
    q_len = starts[req + 1] - starts[req]
    return meta.seq_lens[req].long() - q_len + (t - starts[req])


def cache_pages(kv_cache: torch.Tensor, head_size: int, dtype: torch.dtype | None = None):
    """vLLM's per-layer cache ``[num_blocks, heads_kv, block_size, 2 * head_size]`` -> key and value
    pages ``[num_blocks, block_size, heads_kv, head_size]`` each (views, no copy), viewed as ``dtype``
    (an FP8 cache is a uint8 tensor) when given."""
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return (k, v) if dtype is None or dtype == kv_cache.dtype else (k.view(dtype), v.view(dtype))


class FoldAttentionImpl(AttentionImpl[FoldMetadata]):
    """Args beyond vLLM's: ``read`` (:class:`ServeRead`), ``rope`` (the drafter's :class:`fold.Rope`, as
    vLLM rotates its queries and keys), ``sinks`` ([num_heads] logits or None), ``sliding_window``,
    ``causal`` and ``softcap`` (the layer's own; ``softcap``: its ``logits_soft_cap``, or None)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, *, read: ServeRead,
                 rope: fold.Rope, sinks: torch.Tensor | None = None, kv_cache_dtype: str = "auto",
                 sliding_window: int | None = None, causal: bool = False, softcap: float | None = None):
        if kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"fold: kv_cache_dtype {kv_cache_dtype!r} is not served; fold's backend takes "
                             f"{sorted(CACHE_DTYPES)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = CACHE_DTYPES[kv_cache_dtype]
        self.kv_sharing_target_layer_name = None
        self.attn_type = AttentionType.DECODER
        self.read, self.rope, self.sinks = read, rope, sinks
        self.sliding_window, self.causal, self.softcap = sliding_window, causal, softcap or None
        self.far_bounds: torch.Tensor | None = None        # [num_blocks, heads_kv, 2, head_size] float32
        self.context_positions: torch.Tensor | None = None  # set around the DFlash context precompute
        # the un-rotation R_{-j} of a key vLLM rotated at j: a pure rotation, and 1/f off its rotary dims (R_j
        # carries YaRN's attention factor f), so the cache holds k itself
        self.unrotate_factor = 1.0 / rope.attention_factor

    @property
    def budgeted(self) -> bool:
        """The far branch reads at most ``far_budget`` entries (``read="fold"`` with a budget)."""
        return self.read.read == "fold" and self.read.far_budget is not None

    def bounds_for(self, k_pages: torch.Tensor) -> torch.Tensor:
        """The layer's far-page bounds ``[num_blocks, heads_kv, 2, head_size]`` float32 for key pages
        ``[num_blocks, block_size, heads_kv, head_size]``, allocated (empty, ``(-inf, +inf)``) the first
        time and again if vLLM hands over a cache of another shape; checks ``far_page`` against the
        pages (shapes only)."""
        from fold.far_pages import empty_bounds

        blocks, page, heads_kv, _ = k_pages.shape
        self.read.check_pages(page)
        want = (blocks, heads_kv, 2, self.head_size)
        if self.far_bounds is None or tuple(self.far_bounds.shape) != want or self.far_bounds.device != k_pages.device:
            self.far_bounds = empty_bounds(blocks, heads_kv, self.head_size, device=k_pages.device)
        return self.far_bounds

    def scales(self, layer) -> tuple[float, float]:
        """``(k_scale, v_scale)``: the layer's FP8 scales (host floats, as vLLM keeps them), else 1."""
        if self.cache_dtype is None:
            return 1.0, 1.0
        return float(layer._k_scale_float), float(layer._v_scale_float)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: FoldMetadata | None, output,
                output_scale=None, output_block_scale=None):
        """``query [num_tokens, num_heads, head_size]`` (rotated at its positions) -> ``output`` of the
        same shape; ``key, value [num_tokens, num_kv_heads, head_size]`` (keys rotated at their positions,
        or None) are written first (:meth:`write`), un-rotated at ``seq_len - q_len + r`` of their request."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fold's vLLM backend has no fused output quantization")
        if attn_metadata is None:                                            # profiling / warm-up
            return output.fill_(0)
        meta, tokens = attn_metadata, attn_metadata.num_actual_tokens
        if key is not None and value is not None:
            self.write(layer, key[:tokens], value[:tokens], kv_cache, meta.slot_mapping[:tokens],
                       block_positions(meta, tokens))
        k_pages, v_pages = cache_pages(kv_cache, self.head_size, self.cache_dtype)
        scales = self.scales(layer)
        q, out = query[:tokens], output[:tokens]
        if meta.uniform:
            n_q = meta.max_query_len
            o = self.attend(q.view(meta.num_reqs, n_q, self.num_heads, self.head_size), k_pages, v_pages,
                            meta.seq_lens, meta.block_table, scales)
            out.copy_(o.reshape(out.shape))
            return output
        starts = meta.query_start_loc_cpu.tolist()                           # a batch of unequal queries
        for b in range(meta.num_reqs):
            lo, hi = starts[b], starts[b + 1]
            if hi > lo:
                o = self.attend(q[lo:hi][None], k_pages, v_pages, meta.seq_lens[b:b + 1],
                                meta.block_table[b:b + 1], scales)
                out[lo:hi].copy_(o[0])
        return output

    def attend(self, q, k_pages, v_pages, seq_lens, block_table, scales=(1.0, 1.0)) -> torch.Tensor:
        """``q [batch, n_q, num_heads, head_size]`` over the pages -> ``[batch, n_q, num_heads, head_size]``:
        one ``fold.attention`` call (no host sync), then the sinks' merge."""
        read = self.read
        if read.read == "rerope":
            q = q * rerope_scale(seq_lens, q.shape[1], read.training_length)[:, :, None, None].to(q.dtype)
        budget = {}
        if self.budgeted:
            budget = dict(far_budget=read.far_budget, far_page=k_pages.shape[1], far_bounds=self.bounds_for(k_pages),
                          far_rank=read.far_rank)
        o, lse = fold.attention(
            q, k_pages, v_pages, window=read.window, rope=self.rope, alpha=read.alpha if read.read == "fold" else 1.0,
            cache_seqlens=seq_lens, block_table=block_table, keys_rotated=False, queries_rotated=True,
            softmax_scale=self.scale, return_lse=True, far_position=FAR_POSITION[read.read],
            sliding_window=self.sliding_window, causal=self.causal, k_scale=scales[0], v_scale=scales[1],
            softcap=self.softcap, backend=read.backend, check_ranges=False, **budget)
        if self.sinks is not None:                       # a sink: one more entry of logit s_h and value 0
            total = torch.logaddexp(lse, self.sinks.to(lse.dtype)[None, None, :])
            o = (o.to(lse.dtype) * torch.exp(lse - total)[..., None]).to(q.dtype)
        return o

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """The DFlash context precompute's write (vLLM calls it directly, positions handed around the call by
        :func:`fold.vllm.models.hand_context_positions`): :meth:`write` at :attr:`context_positions`."""
        positions = self.context_positions
        if positions is None or positions.shape[0] < slot_mapping.shape[0]:
            raise RuntimeError("fold: a key write without the keys' positions (fold's cache holds keys un-rotated); "
                               "vLLM wrote a drafter layer's cache outside the context precompute fold wraps")
        self.write(layer, key, value, kv_cache, slot_mapping, positions[:slot_mapping.shape[0]], bounds=True)

    def write(self, layer, key, value, kv_cache, slot_mapping, positions, bounds: bool = False) -> None:
        """Write ``key, value [T, num_kv_heads, head_size]`` (keys rotated at ``positions [T]``) at
        ``slot_mapping [T]`` (slot = page * block_size + offset; negative slots are padding): each key
        un-rotated (``R_{-j}``, the attention factor off), then quantized for an FP8 cache.

        One scatter, no host sync: a padding row rewrites slot 0 (vLLM's null block, which holds no
        request's entries) with the value it read there, so padding changes nothing. With a far budget and
        ``bounds`` (the precompute's writes: every committed entry) the written keys also go into the layer's
        far-page bounds (``fold.far_pages.update_bounds``, in place), dequantized as the read will see them;
        the block's own rows, written by the drafting forward, are not: they are never far in the round that
        writes them, and the precompute rewrites each committed one at its slot."""
        k_pages, v_pages = cache_pages(kv_cache, self.head_size)          # as stored (uint8 for FP8)
        count = slot_mapping.shape[0]
        valid = slot_mapping >= 0
        slots = torch.where(valid, slot_mapping, 0).long()
        page, offset = slots // k_pages.shape[1], slots % k_pages.shape[1]
        keep = valid[:, None, None]
        k_scale, v_scale = self.scales(layer)
        key = rotate(key[:count].transpose(0, 1), -positions.long(), self.rope,
                     factor=self.unrotate_factor).transpose(0, 1)
        for pages, x, scale in ((k_pages, key, k_scale), (v_pages, value[:count], v_scale)):
            pages[page, offset] = torch.where(keep, self.stored(x, scale, pages.dtype), pages[page, offset])
        if bounds and self.budgeted:
            self.update_bounds(key, slot_mapping, k_pages, k_scale)

    def update_bounds(self, key, slot_mapping, k_pages, k_scale: float = 1.0) -> None:
        """Fold ``key [T, num_kv_heads, head_size]`` (un-rotated, written at ``slot_mapping [T]``, negative =
        padding) into the far-page bounds, as the cache holds them (an FP8 cache: quantized, then times
        ``k_scale``)."""
        from fold.far_pages import update_bounds

        bounds = self.bounds_for(k_pages)
        if self.cache_dtype is not None:
            key = (key.to(torch.float32) / k_scale).to(self.cache_dtype).to(torch.float32) * k_scale
        update_bounds(bounds, key, far_page=k_pages.shape[1], slot_mapping=slot_mapping)

    def stored(self, x: torch.Tensor, scale: float, stored_dtype: torch.dtype) -> torch.Tensor:
        """``x`` as the cache stores it: ``x / scale`` in FP8 (viewed as the cache's uint8), else cast."""
        if self.cache_dtype is None:
            return x.to(stored_dtype)
        return (x.to(torch.float32) / scale).to(self.cache_dtype).view(stored_dtype)

