"""fold's two ops as ``torch.library`` custom ops, behind the public functions' validation.

``torch.compile`` sees ``fold::attention`` and ``fold::tree_attention`` as single nodes: their fake
implementations give the output shapes, so a compiled model traces through them without a graph
break (``fullgraph=True``), and CUDA graphs capture the launches (nothing inside syncs with the
host on CUDA). The real implementations pick the backend: the torch path or the Triton launchers
(with the launch configuration looked up at call time, so ``fold.config_lookup.use_config`` and the
tuned caches apply in compiled code too).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from fold.rope import Rope, work_dtype

_ROPES: OrderedDict = OrderedDict()     # the torch path's Rope (and its cos/sin tables) per rotary embedding


def _rope(inv_freq, rotary_dim, interleaved, attention_factor) -> Rope:
    """The Rope with these parameters, kept (with its tables) for the next call; keyed by value."""
    key = (inv_freq.detach().cpu().numpy().tobytes(), rotary_dim, interleaved, attention_factor)
    rope = _ROPES.get(key)
    if rope is None:
        rope = _ROPES[key] = Rope(inv_freq.detach().cpu(), rotary_dim, interleaved, attention_factor)
        if len(_ROPES) > 16:
            _ROPES.popitem(last=False)
    _ROPES.move_to_end(key)
    return rope


def _unit_stride(*tensors):
    return [x if x is None or x.stride(-1) == 1 else x.contiguous() for x in tensors]


@torch.library.custom_op("fold::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor,
                 cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None, window: int, alpha: float,
                 softmax_scale: float, rotary_dim: int, interleaved: bool, attention_factor: float,
                 keys_rotated: bool, far_per_row: bool, queries_rotated: bool, backend: str, read_far: bool,
                 sliding_window: int, causal: bool, k_scale: float, v_scale: float,
                 far_pages: torch.Tensor | None = None, far_page: int = 0,
                 softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs (see ``fold.attention``; ``sliding_window = -1`` for none; ``far_pages [B, Hkv, K]``
    int32 the far pages to read, from :func:`fold.far_pages.select_pages`, of ``far_page`` entries;
    ``softcap = 0`` for none) -> ``(out, lse)``, lse natural log."""
    read = dict(window=window, alpha=alpha, softmax_scale=softmax_scale, keys_rotated=keys_rotated, return_lse=True,
                block_table=block_table, far_per_row=far_per_row, queries_rotated=queries_rotated, read_far=read_far,
                sliding_window=None if sliding_window < 0 else sliding_window, causal=causal, k_scale=k_scale,
                v_scale=v_scale, far_pages=far_pages, far_page=far_page, softcap=softcap)
    if backend == "torch":
        from fold.torch_path import fold_attention_torch

        return fold_attention_torch(q, k, v, _rope(inv_freq, rotary_dim, interleaved, attention_factor),
                                    cache_seqlens, **read)
    from fold.config_lookup import config_for
    from fold.kernels.fold_attention import fold_attention_fwd

    q, k, v = _unit_stride(q, k, v)
    config = config_for(q, k, keys_rotated, block_table=block_table)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return fold_attention_fwd(q, k, v, inv_freq, cache_seqlens, rotary_dim=rotary_dim, interleaved=interleaved,
                                  attention_factor=attention_factor, config=config, **read)


@attention_op.register_fake
def _attention_fake(q, *args, **kwargs):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=work_dtype(q.dtype))


@torch.library.custom_op("fold::tree_attention", mutates_args=())
def tree_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_tree: torch.Tensor,
                      v_tree: torch.Tensor, tree_mask: torch.Tensor, cache_seqlens: torch.Tensor | None,
                      block_table: torch.Tensor | None, softmax_scale: float,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated inputs (see ``fold.tree_attention``) -> ``(out, lse)``, lse natural log."""
    if backend == "torch":
        from fold.torch_path import tree_attention_torch

        return tree_attention_torch(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens,
                                    softmax_scale=softmax_scale, return_lse=True, block_table=block_table)
    from fold.config_lookup import config_for
    from fold.kernels.tree_attention import tree_attention_fwd

    q, k_cache, v_cache, k_tree, v_tree = _unit_stride(q, k_cache, v_cache, k_tree, v_tree)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return tree_attention_fwd(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens,
                                  softmax_scale=softmax_scale, return_lse=True,
                                  config=config_for(q, k_cache, True, block_table=block_table),
                                  block_table=block_table)


@tree_attention_op.register_fake
def _tree_attention_fake(q, *args, **kwargs):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=work_dtype(q.dtype))
