"""Rolling a target's cache back to the committed entries, per layer kind.

The loop verifies ``[anchor] + drafts`` in one forward and then keeps only the accepted prefix,
so each layer type of the target's cache must roll back exactly:

- full attention (``DynamicLayer``): ``crop(-removed)``.
- sliding window (``DynamicSlidingWindowLayer``): transformers' past recording, switched on for a
  verification (so the prompt never sits in full in a sliding layer); the verification's keys are
  kept until ``crop(-removed)`` trims the rejected ones and shrinks the layer back to ``W - 1``.
- linear attention (``LinearAttentionLayer``, Qwen3.5's Gated DeltaNet): fold does not switch
  transformers' recording on for these layers (before 5.25 it keeps the conv inputs but *not* the
  recurrent state, which the verification forward overwrites with the state after every drafted
  token). Before each verification the conv and recurrent states are copied (one copy per layer,
  not one per position); on a rejection they are put back in place and the accepted rows are
  replayed through that layer's mixer alone, from its input in the verification's
  ``hidden_states`` (exact: the same recurrence over the accepted tokens). When every draft is
  accepted the state after the verification is already right and nothing is replayed. The cost per
  round is recorded in ``fold/spec_decode/FAMILIES.md``. transformers 5.25 can keep the recurrent states
  itself (``activate_past_recording(recurrent_states_to_keep=k)``); fold keeps its replay, which
  holds on every tested release (5.22 to 5.25) and copies one state per layer, not ``k``.

Everything that depends on the transformers release (which cache layer classes exist, how past
recording is switched, the linear layers' token counter of 5.25) is in the helpers at the top.

A tree verification keeps an arbitrary path (:func:`keep_path`) in full and sliding layers;
linear-attention targets are refused for trees (:func:`fold.spec_decode.target.check_target`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from fold.spec_decode.target import cache_kwarg, decoder_layers


def _cache_class(name: str):
    """A class of ``transformers.cache_utils``, or None where this release has none of that name
    (``DummyLayer`` is 5.24+; 5.22 leaves KV-sharing consumers out of the cache instead)."""
    from transformers import cache_utils

    return getattr(cache_utils, name, None)


def layer_kind(layer) -> str:
    """``"linear"``, ``"sliding"``, ``"full"`` or ``"none"`` (a KV-sharing consumer stores nothing)."""
    linear, dummy = _cache_class("LinearAttentionCacheLayerMixin"), _cache_class("DummyLayer")
    if linear is not None and isinstance(layer, linear):
        return "linear"
    if dummy is not None and isinstance(layer, dummy):
        return "none"
    return "sliding" if getattr(layer, "is_sliding", False) else "full"


def set_recording(layer, on: bool) -> None:
    """Switch a sliding layer's past recording on (transformers' public ``activate_past_recording``)
    or off. transformers has no public switch-off; every tested release (5.22 to 5.25) reads the
    flag ``record_past`` alone, so off clears it."""
    if on:
        layer.activate_past_recording()
    else:
        layer.record_past = False


def _set_linear_length(layer, length: int) -> None:
    """transformers 5.25 counts a linear layer's tokens (``cumulative_length_linear``, read by
    ``Cache.get_seq_length`` when layer 0 is linear); after a rollback it must say ``length``."""
    counter = getattr(layer, "cumulative_length_linear", None)
    if isinstance(counter, torch.Tensor):
        counter.fill_(length)


def cache_layers(cache):
    return getattr(cache, "layers", None) or []


def seq_length(cache) -> int:
    """Entries the cache holds (the position of the next token)."""
    return cache.get_seq_length()


@dataclass
class Replay:
    """What a rollback of linear-attention layers needs from a verification forward."""

    snapshots: dict           # layer index -> (conv state, recurrent state) before the forward
    hidden_states: tuple      # the forward's hidden_states: entry i is the input of decoder layer i
    new_tokens: int


def copy_linear_states(cache) -> dict:
    """``{layer index: (conv state, recurrent state)}`` copies of every linear-attention layer."""
    out = {}
    for i, layer in enumerate(cache_layers(cache)):
        if layer_kind(layer) == "linear" and layer.has_previous_state[0]:
            out[i] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
    return out


def record(cache, on: bool) -> dict:
    """Before a forward on ``cache``: sliding layers record it (``on``, a verification) or not (plain
    decoding). Returns the linear layers' state copies a rollback of it will need."""
    for layer in cache_layers(cache):
        if layer_kind(layer) == "sliding":
            set_recording(layer, on)
    return copy_linear_states(cache) if on else {}


def _replay_linear(target, replay: Replay, cache, index: int, keep: int) -> None:
    """Put linear-attention layer ``index`` back to its state before the verification (in place), then
    run the verification's first ``keep`` rows through that layer's mixer again."""
    layer = cache.layers[index]
    conv, recurrent = replay.snapshots[index]
    layer.conv_states[0].copy_(conv)
    layer.recurrent_states[0].copy_(recurrent)
    if keep:
        decoder = decoder_layers(target)[index]
        x = decoder.input_layernorm(replay.hidden_states[index][:, :keep])
        decoder.linear_attn(x, **{cache_kwarg(type(decoder.linear_attn).forward): cache})


def crop(target, cache, length: int, replay: Replay | None) -> None:
    """Keep the first ``length`` entries of every layer (``replay``: the verification's, for linear layers)."""
    layers = cache_layers(cache)
    current = seq_length(cache)
    removed = current - length
    if removed < 0:
        raise ValueError(f"cannot crop a cache of {current} entries to {length}")
    if not layers:                                            # transformers 4.x tuple-style caches
        if removed:
            if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
                cache.crop(-removed)
            else:
                cache.crop(length)
        return
    for i, layer in enumerate(layers):
        kind = layer_kind(layer)
        if kind == "linear":
            if removed and (replay is None or i not in replay.snapshots):
                raise RuntimeError(f"linear-attention layer {i}: no state saved before the last forward, so its "
                                   "recurrent state cannot be rolled back")
            if removed:
                _replay_linear(target, replay, cache, i, replay.new_tokens - removed)
                _set_linear_length(layer, length)
        elif kind == "sliding":
            layer.crop(-removed)                              # crop(0) shrinks back to the window
        elif kind == "full" and removed:
            layer.crop(-removed)


def keep_path(cache, n_tree: int, kept) -> None:
    """After a tree forward of ``n_tree`` nodes: keep the committed entries and the tree nodes ``kept``
    (indices into the tree, in order) in every full and sliding layer."""
    kept = torch.as_tensor(kept)
    layers = cache_layers(cache)
    if not layers:                                            # transformers 4.x
        for i in range(len(cache.key_cache)):
            n_old = cache.key_cache[i].shape[2] - n_tree
            idx = torch.cat([torch.arange(n_old), n_old + kept]).to(cache.key_cache[i].device)
            cache.key_cache[i] = cache.key_cache[i].index_select(2, idx)
            cache.value_cache[i] = cache.value_cache[i].index_select(2, idx)
        return
    for layer in layers:
        kind = layer_kind(layer)
        if kind == "linear":
            raise ValueError("a linear-attention layer cannot keep a tree path (see check_target)")
        if kind == "none" or not layer.is_initialized:
            continue
        n_old = layer.keys.shape[2] - n_tree
        idx = torch.cat([torch.arange(n_old), n_old + kept]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(2, idx)
        layer.values = layer.values.index_select(2, idx)
        if kind == "sliding":
            layer.cumulative_length += len(kept) - n_tree
            layer.keys = layer.keys[:, :, -layer.sliding_window + 1:]
            layer.values = layer.values[:, :, -layer.sliding_window + 1:]


def layer_keys(cache, index: int):
    """Keys of layer ``index`` of a dynamic cache, ``[B, Hkv, T, d]`` (post-RoPE)."""
    if hasattr(cache, "layers"):
        return cache.layers[index].keys
    return cache.key_cache[index]


def layer_values(cache, index: int):
    """Values of layer ``index`` of a dynamic cache, ``[B, Hkv, T, d]``."""
    if hasattr(cache, "layers"):
        return cache.layers[index].values
    return cache.value_cache[index]


def key_layer(cache, index: int, layer_types) -> int:
    """The cache layer holding the keys that layer ``index`` reads: itself, or for a KV-sharing
    consumer (Gemma-4's ``num_kv_shared_layers``) the last earlier layer of its type that stores them."""
    layers = cache_layers(cache)
    if not layers or (index < len(layers) and layer_kind(layers[index]) != "none"):
        return index
    # a consumer: a DummyLayer (5.24+), or past the end of a cache that leaves consumers out (5.22)
    return max(i for i in range(min(index, len(layers)))
               if layer_types[i] == layer_types[index] and layer_kind(layers[i]) != "none")
