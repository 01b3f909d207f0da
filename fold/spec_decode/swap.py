"""The one attention swap: within a block, a target's attention layers run a function of fold's.

Importing this module registers a single implementation, ``"fold"``, with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``; both read the function (and the mask builder)
of the innermost active :func:`attention_swapped` block, so nothing is registered per call. fold's
reads mask themselves (no mask is built); :func:`grouped_verification` runs :func:`grouped_sdpa` under
the masks transformers' SDPA would get.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fold.spec_decode.target import attn_implementation, dispatches_attention

_ACTIVE = contextvars.ContextVar("fold_spec_attention", default=None)    # (fn, mask) inside attention_swapped


def _attention(module, query, key, value, attention_mask, **kwargs):
    return _ACTIVE.get()[0](module, query, key, value, attention_mask, **kwargs)


def _mask(*args, **kwargs):
    mask = _ACTIVE.get()[1]
    return None if mask is None else mask(*args, **kwargs)


AttentionInterface.register("fold", _attention)
AttentionMaskInterface.register("fold", _mask)


@contextlib.contextmanager
def attention_swapped(target, fn, mask=None):
    """Inside the block ``target``'s attention runs ``fn(module, query, key, value, attention_mask,
    **kwargs)`` (transformers' ``AttentionInterface`` signature) with the masks ``mask`` builds (a
    transformers mask function such as ``sdpa_mask``; None: no mask). The previous implementation is
    restored on exit."""
    previous = attn_implementation(target)
    token = _ACTIVE.set((fn, mask))
    target.set_attn_implementation("fold")
    try:
        yield
    finally:
        target.set_attn_implementation(previous)
        _ACTIVE.reset(token)


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention for a multi-token forward of a grouped-query target, without
    ``repeat_kv``: ``query [B, Hq, T, d]`` is read as ``[B, Hkv, g*T, d]`` (the ``g`` query heads of a
    key/value head are consecutive) under the mask repeated ``g`` times, so the cached keys and values
    are read once instead of copied ``g`` times per layer (transformers does so for one query token;
    a masked forward of several, a verification, copies). The same products and sums as transformers'
    own SDPA; anything else (one token, no mask, per-head masks, dropout, soft-capping, sinks, a
    position bias, no grouping) goes to transformers' function unchanged. Returns ``([B, T, Hq, d], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, hq, t, d = query.shape
    hkv = key.shape[1]
    mask = attention_mask
    if (hq == hkv or t == 1 or mask is None or mask.ndim != 4 or mask.shape[1] != 1 or dropout
            or any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    g = hq // hkv
    mask = mask[..., :key.shape[2]]
    mask = mask.expand(mask.shape[0], 1, t, mask.shape[-1]).repeat(1, 1, g, 1)           # [B|1, 1, g*T, L]
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, g * t, d), key, value,
                                                           attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, value.shape[-1]).transpose(1, 2).contiguous(), None


def grouped_verification(target):
    """A block in which a target on transformers' ``"sdpa"`` attention runs :func:`grouped_sdpa` (under
    SDPA's masks); any other implementation is left alone."""
    if attn_implementation(target) != "sdpa" or not dispatches_attention(target):
        return contextlib.nullcontext()
    return attention_swapped(target, lambda *args, **kwargs: grouped_sdpa(*args, **kwargs), mask=sdpa_mask)
