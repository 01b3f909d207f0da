"""vLLM's DFlash / DSpark drafter classes with their attention layers served by fold.

Each class here subclasses vLLM's own (:data:`fold.vllm.compat.DRAFTERS`) and, after vLLM built it,
hands every drafter attention layer to :class:`fold.vllm.backend.FoldAttentionBackend` when the
drafter's config.json asks for a fold read. Nothing of vLLM's forward is patched: queries and keys are
rotated by vLLM as always, and only the layer's backend (its read and its cache layout) changes.
"""

from __future__ import annotations

import importlib

import torch

import fold
from fold.vllm import compat
from fold.vllm.backend import NAME, FoldAttentionBackend, FoldAttentionImpl
from fold.vllm.config import read_of


def rope_of(rotary_emb) -> fold.Rope:
    """The :class:`fold.Rope` that reproduces a vLLM rotary embedding, checked against its cos/sin cache
    (``[max_position, rotary_dim]``: cos then sin, times the embedding's scale)."""
    inv_freq = rotary_emb._compute_inv_freq(rotary_emb.base).to(torch.float32)       # vLLM 0.32's RotaryEmbedding
    table = rotary_emb.cos_sin_cache.detach().to("cpu", torch.float64)
    factor = float(table[0, 0])                                                        # cos(0) x scale
    rope = fold.Rope(inv_freq, rotary_dim=rotary_emb.rotary_dim, interleaved=not rotary_emb.is_neox_style,
                     attention_factor=factor)
    positions = torch.tensor(sorted({1, 7, table.shape[0] // 2, table.shape[0] - 1}))
    angle = positions[:, None].double() * inv_freq.double()[None, :]
    want = torch.cat((torch.cos(angle), torch.sin(angle)), dim=-1) * factor
    # vLLM forms the angles in float32: its table drifts by ~1e-7 x position from the float64 angles
    tolerance = (1e-5 + 1e-7 * positions.double())[:, None] * factor
    if table.shape[1] != rotary_emb.rotary_dim or bool(((table[positions] - want).abs() > tolerance).any()):
        raise ValueError(f"fold cannot reproduce this drafter's rotary embedding ({type(rotary_emb).__name__}): "
                         "its cos/sin cache is not cos/sin(position x inv_freq) times one scale")
    return rope


def install(model: torch.nn.Module, vllm_config) -> int:
    """Serve ``model``'s drafter attention layers by fold if its config asks; returns how many layers.
    A layer fold cannot serve (a causal full-attention layer; a sliding one with sinks) is a
    ``ValueError`` naming the layer."""
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    read = read_of(hf_config)
    if not read.active:
        return 0
    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(getattr(module, "attn", None), compat.Attention) and hasattr(module, "rotary_emb")]
    if not layers:
        raise ValueError(f"fold: found no attention layer with a rotary embedding in {type(model).__name__}")
    for name, module in layers:
        attn, impl = module.attn, module.attn.impl
        sliding, causal = getattr(module, "sliding_window", None), bool(getattr(module, "causal", False))
        sinks = getattr(module, "attention_sink_bias", None)
        if sliding is None and causal:
            raise ValueError(f"fold: drafter layer {name} is a causal full-attention layer; fold's read takes a "
                             "bidirectional draft block")
        if sliding is not None and (sinks is not None or abs(impl.scale * impl.head_size ** 0.5 - 1) > 1e-6):
            raise ValueError(f"fold: drafter layer {name} is a sliding-window layer with attention sinks or a "
                             "softmax scale other than head_size ** -0.5, which fold's sliding rules do not take")
        attn.impl = FoldAttentionImpl(impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads, read=read,
                                      rope=rope_of(module.rotary_emb), sinks=sinks,
                                      kv_cache_dtype=getattr(attn, "kv_cache_dtype", "auto"),
                                      sliding_window=sliding, causal=causal)
        attn.attn_backend = FoldAttentionBackend
        attn.backend = compat.AttentionBackendEnum[NAME]
        # vLLM frees a sliding layer's pages once they leave its window; FOLD reads them as far memory,
        # so the layer asks for a full-attention cache (its read still applies the window)
        attn.sliding_window = None
    return len(layers)


_CLASSES: dict[str, type] = {}


def fold_class(arch: str) -> type:
    """The fold-served subclass of vLLM's class for drafter architecture ``arch``."""
    if arch not in _CLASSES:
        module, name = compat.DRAFTERS[arch]
        base = getattr(importlib.import_module(module), name)

        def __init__(self, *, vllm_config, prefix: str = ""):
            base.__init__(self, vllm_config=vllm_config, prefix=prefix)
            install(self, vllm_config)

        _CLASSES[arch] = type(f"Fold{arch}", (base,), {"__init__": __init__, "__module__": __name__})
    return _CLASSES[arch]


def __getattr__(name: str):
    # "fold.vllm.models:Fold<arch>" is what the plug-in registers (resolved lazily, in every process)
    if name.startswith("Fold") and name[4:] in compat.DRAFTERS:
        return fold_class(name[4:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
