"""The few transformers calls the loop makes, across the 4.x and 5.x APIs."""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_kwarg(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def forward(target, ids, cache=None, position_ids=None):
    """``target(ids)`` with its cache and hidden states -> (logits [B, T, V], hidden_states tuple, cache)."""
    kwargs = {_cache_kwarg(type(target).forward): cache} if cache is not None else {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = target(ids, use_cache=True, output_hidden_states=True, **kwargs)
    new_cache = out["cache"] if "cache" in out else out["past_key_values"]
    return out.logits, out.hidden_states, new_cache


def crop(cache, length: int) -> None:
    """Keep the first ``length`` entries of every layer of ``cache``."""
    current = cache.get_seq_length()
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:   # transformers >= 5.x
        if current > length:
            cache.crop(length - current)
    else:
        cache.crop(length)


def layer_keys(cache, index: int):
    """Keys of layer ``index`` of a dynamic cache, ``[B, Hkv, T, d]`` (post-RoPE)."""
    if hasattr(cache, "layers"):
        return cache.layers[index].keys
    return cache.key_cache[index]


def keep(cache, indices) -> None:
    """Keep the entries ``indices`` (sorted, [K]) of every layer of ``cache``, in that order."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, indices)
            layer.values = layer.values.index_select(2, indices)
    else:
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = cache.key_cache[i].index_select(2, indices)
            cache.value_cache[i] = cache.value_cache[i].index_select(2, indices)


def layer_values(cache, index: int):
    """Values of layer ``index`` of a dynamic cache, ``[B, Hkv, T, d]``."""
    if hasattr(cache, "layers"):
        return cache.layers[index].values
    return cache.value_cache[index]
