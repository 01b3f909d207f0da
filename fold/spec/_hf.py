"""Every transformers call the loop makes, across the 4.x and 5.x APIs, and the target's cache.

The loop verifies ``[anchor] + drafts`` in one forward and then keeps only the accepted prefix,
so each layer type of the target's cache must roll back exactly:

- full attention (``DynamicLayer``): ``crop(-removed)``.
- sliding window (``DynamicSlidingWindowLayer``): transformers' past recording, switched on after
  the prefill (so the prompt never sits in full in a sliding layer); the verification's keys are
  kept until ``crop(-removed)`` trims the rejected ones and shrinks the layer back to ``W - 1``.
- linear attention (``LinearAttentionLayer``, Qwen3.5's Gated DeltaNet): transformers records the
  conv inputs but *not* the recurrent state, which the verification forward overwrites with the
  state after every drafted token. So before each verification the conv and recurrent states are
  copied (one copy per layer, not one per position), and on a rejection they are restored and the
  accepted rows are replayed through that layer's mixer alone, from its input in the
  verification's ``hidden_states`` (exact: the same recurrence over the accepted tokens). When
  every draft is accepted the state after the verification is already right and nothing is
  replayed. The cost per round is recorded in ``fold/spec/FAMILIES.md``.

Everything that changes a sequence's cache goes through its :class:`TargetSession`. Tree
verification keeps an arbitrary path: :meth:`TargetSession.keep_tree_path` compacts full and sliding
layers; linear-attention targets are refused for trees (:func:`check_target`), since every tree
node would need its own parent's recurrent state.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import weakref
from dataclasses import dataclass

import torch


@functools.lru_cache(maxsize=None)
def _cache_kwarg(forward) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else "cache_params"


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(forward) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def _layer_kind(layer) -> str:
    """``"linear"``, ``"sliding"``, ``"full"`` or ``"none"`` (a KV-sharing consumer stores nothing)."""
    from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return "linear"
    if isinstance(layer, DummyLayer):
        return "none"
    return "sliding" if getattr(layer, "is_sliding", False) else "full"


def _layers(cache):
    return getattr(cache, "layers", None) or []


def _target_layer_types(target) -> list[str]:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return list(getattr(config, "layer_types", None) or [])


def decoder_layers(target):
    """The target's decoder layers (``target.model.layers``)."""
    model = getattr(target, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(target).__name__} has no .model.layers; fold.spec needs a decoder-only causal LM")
    return layers


def check_target(target, *, tree: bool = False) -> None:
    """Refuse, by name and before any work, a target whose cache the loop cannot roll back or,
    with ``tree``, cannot verify a token tree in."""
    types = _target_layer_types(target)
    known = {"full_attention", "sliding_attention", "linear_attention"}
    unknown = sorted(set(types) - known)
    if unknown:
        raise ValueError(f"{type(target).__name__}: layer_types {unknown} are not supported by fold.spec (it rolls "
                         f"back {sorted(known)} layers)")
    if "linear_attention" in types:
        layers = decoder_layers(target)
        missing = [i for i, t in enumerate(types) if t == "linear_attention"
                   and not (hasattr(layers[i], "linear_attn") and hasattr(layers[i], "input_layernorm"))]
        if missing:
            raise ValueError(f"{type(target).__name__}: linear-attention layers {missing} have no .linear_attn / "
                             ".input_layernorm, so their recurrent state cannot be replayed after a rejection")
        if tree:
            raise ValueError(f"tree verification is not supported for {type(target).__name__}: its linear-attention "
                             "(Gated DeltaNet) layers carry a recurrent state, and every tree node would need the "
                             "state after its own parent, which one chain-shaped forward cannot give; use a chain "
                             "(tree=None)")


# -- one sequence's target: forward, rollback, attention swap ------------------------------------

@dataclass
class _Replay:
    """What a rollback of linear-attention layers needs from the last verification forward."""

    snapshots: dict           # layer index -> (conv state, recurrent state) before the forward
    hidden_states: tuple      # the forward's hidden_states: entry i is the input of decoder layer i
    new_tokens: int


def copy_linear_states(cache) -> dict:
    """``{layer index: (conv state, recurrent state)}`` copies of every linear-attention layer."""
    out = {}
    for i, layer in enumerate(_layers(cache)):
        if _layer_kind(layer) == "linear" and layer.has_previous_state[0]:
            out[i] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
    return out


class TargetSession:
    """One sequence's target: its cache, the rollback its last verification left pending, and the
    attention swap (:meth:`attention`). The loop owns one per sequence; nothing is kept elsewhere.

    Example::

        >>> s = TargetSession(target)
        >>> logits, hidden = s.forward(prompt[None])              # prefill
        >>> logits, hidden = s.forward(block[None])               # a verification, recorded
        >>> s.crop(len(prompt) + accepted)                        # drop the rejected suffix
    """

    def __init__(self, target, prefills: Prefills | None = None):
        self.target, self.prefills = target, prefills
        self.device = next(target.parameters()).device
        self.cache = None
        self.length = 0                           # committed entries: the position of the next token
        self._replay: _Replay | None = None       # set by a verification of a linear-attention target

    def prefill(self, ids) -> tuple[torch.Tensor, tuple]:
        """The prompt ``ids [T]`` forward (or a copy of the shared one, see :class:`Prefills`) ->
        ``(logits of its last position [V], hidden_states)``."""
        if self.prefills is not None:
            return self.prefills.prefill(self, ids)
        logits, hidden_states = self.forward(ids[None])
        return logits[0, -1], hidden_states

    def forward(self, ids, position_ids=None, rollback: bool = True, last_logits_only: bool = False,
                lazy_logits: bool = False):
        """``target(ids)`` on this session's cache -> ``(logits [B, T, V], hidden_states tuple)``
        (``[B, 1, V]`` with ``last_logits_only``: transformers' ``logits_to_keep=1``).

        ``lazy_logits`` (one sequence): the logits come as that sequence's rows ``[T, V]``; on a CPU,
        whose LM head costs in proportion to its rows, as :class:`LogitRows` (a row computed when read)
        once this target is known to give plain ``lm_head(last hidden state)`` logits (checked on its
        first such forward, which returns the tensor's rows).

        With ``rollback`` (a verification) the sliding and linear-attention layers record this
        forward and the linear layers' states are copied first, so that :meth:`crop` can drop any
        suffix of ``ids``; without it (plain decoding) nothing is recorded or copied. A forward after
        a recorded one that was never cropped first commits it (``crop`` to its full length)."""
        cache = self.cache
        kwargs = {_cache_kwarg(type(self.target).forward): cache} if cache is not None else {}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        if lazy_logits and (ids.shape[0] != 1 or last_logits_only):
            raise ValueError(f"lazy_logits takes one sequence's whole forward, got ids of shape {tuple(ids.shape)}"
                             f"{' and last_logits_only' if last_logits_only else ''}")
        lazy = (lazy_logits and self.device.type == "cpu" and _PLAIN_HEAD.get(self.target, False)
                and _takes_logits_to_keep(type(self.target).forward))
        if lazy:                                                   # the model computes row 0 only
            kwargs["logits_to_keep"] = torch.zeros(1, dtype=torch.long, device=self.device)
        snapshots = {}
        if cache is not None:
            if self._replay is not None or any(getattr(layer, "record_past", False) for layer in _layers(cache)):
                replay, self._replay = self._replay, None      # commit the last recorded forward:
                _crop(self.target, cache, seq_length(cache), replay)   # shrink what it kept
            for layer in _layers(cache):
                if _layer_kind(layer) in ("sliding", "linear"):
                    layer.record_past = rollback
            snapshots = copy_linear_states(cache) if rollback else {}
        # a verification reads the cache with several query rows under a mask: grouped, not repeated
        swap = grouped_verification(self.target) if rollback and cache is not None and ids.shape[1] > 1 \
            else contextlib.nullcontext()
        with swap:
            out = self.target(ids, use_cache=True, output_hidden_states=True, **kwargs)
        self.cache = out["cache"] if "cache" in out else out["past_key_values"]
        self.length += ids.shape[1]
        if snapshots:
            self._replay = _Replay(snapshots, out.hidden_states, ids.shape[1])
        if lazy:
            return LogitRows(out.hidden_states[-1][0], self.target.get_output_embeddings(), first=out.logits[0, 0]), \
                out.hidden_states
        if lazy_logits and self.device.type == "cpu" and ids.shape[1] > 1 and self.target not in _PLAIN_HEAD:
            _PLAIN_HEAD[self.target] = _is_plain_head(self.target, out.logits[0], out.hidden_states[-1][0])
        return (out.logits[0] if lazy_logits else out.logits), out.hidden_states

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries of every layer, whatever the layer type."""
        replay, self._replay = self._replay, None
        _crop(self.target, self.cache, length, replay)
        self.length = length

    def keep_tree_path(self, n_tree: int, kept) -> None:
        """After a tree forward of ``n_tree`` nodes: keep the committed entries and the tree nodes
        ``kept`` (indices into the tree, in order) in every full and sliding layer."""
        _keep_tree_path(self.cache, n_tree, kept)
        self.length += len(kept) - n_tree

    @property
    def can_swap_attention(self) -> bool:
        """Whether the target dispatches its attention through transformers' ``AttentionInterface``."""
        return bool(getattr(self.target, "_supports_attention_backend", False))

    def attention(self, fn):
        """Within the block, every attention layer of the target runs ``fn(module, query, key, value,
        attention_mask, **kwargs)`` (transformers' ``AttentionInterface`` signature)."""
        return attention_swapped(self.target, fn)


_PLAIN_HEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # target -> logits == lm_head(last hidden)


def _is_plain_head(target, logits: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether ``target``'s logits ``[T, V]`` of a forward are exactly its output embeddings applied to
    the last entry of its ``hidden_states`` (``hidden [T, H]``) and nothing else: no soft-capping,
    scale or bias after the head. The same product on the same rows, so compared bit for bit."""
    head = target.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return False
    with torch.no_grad():
        return torch.equal(head(hidden), logits)


class LogitRows:
    """Logits ``[T, V]`` of one sequence, each row computed the first time it is read (``rows[i] ->
    [V]``) as ``head(hidden[i:i + 1])[0]``: acceptance reads a verification's rows only up to the first
    mismatch, and a chain with a cutoff a drafter's only up to the first unsure slot, so each pays its
    LM head for the rows it looks at. ``first``: row 0 if already computed (by the model's forward)."""

    def __init__(self, hidden: torch.Tensor, head, first: torch.Tensor | None = None):
        self._rows = {} if first is None else {0: first}
        self._hidden, self._head = hidden, head           # final hidden states [T, H], [k, H] -> [k, V]

    def __len__(self) -> int:
        return self._hidden.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        if i not in self._rows:
            with torch.no_grad():
                self._rows[i] = self._head(self._hidden[i:i + 1])[0]
        return self._rows[i]


class Prefills:
    """Prompt forwards shared by every run on ``target`` that passes this object (``spec.generate`` /
    ``spec.autoregressive``'s ``prefill=``): each prompt is run once and every later run starts from a
    copy of its cache, so rows, policies and drafters compared on the same prompts pay one prefill
    (TPOT excludes it, so no number changes). ``keep`` bounds the prompts held (oldest dropped
    first; None keeps all); ``last_logits_only`` runs the prompt with ``logits_to_keep=1`` (the loop
    reads the last row; a long prompt's full logits are large) for targets that take it.

    Example::

        >>> shared = spec.Prefills(target)
        >>> ar = spec.autoregressive(target, ids, max_new_tokens=64, prefill=shared)
        >>> runs = {p: spec.generate(target, drafter, ids, max_new_tokens=64, policy=p, prefill=shared)
        ...         for p in ("dflash", "fold")}                  # one prompt forward per prompt in all
    """

    def __init__(self, target, keep: int | None = None, last_logits_only: bool = False):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        if not isinstance(last_logits_only, bool):
            raise TypeError(f"last_logits_only must be a bool, got {type(last_logits_only).__name__}")
        self.target, self.keep, self.last_logits_only = target, keep, last_logits_only
        self._held: dict[tuple, tuple] = {}       # prompt -> (last logits, hidden_states, cache)

    def prefill(self, session: TargetSession, ids) -> tuple[torch.Tensor, tuple]:
        key = tuple(ids.tolist())
        if key not in self._held:
            fresh = TargetSession(self.target)
            logits, hidden_states = fresh.forward(ids[None], last_logits_only=self.last_logits_only)
            if self.keep is not None and len(self._held) >= self.keep:
                self._held.pop(next(iter(self._held)))
            self._held[key] = (logits[0, -1].clone(), hidden_states, fresh.cache)
        logits, hidden_states, cache = self._held[key]
        session.cache, session.length = copy.deepcopy(cache), len(key)
        return logits, hidden_states


def seq_length(cache) -> int:
    """Entries the cache holds (the position of the next token)."""
    return cache.get_seq_length()


_ACTIVE = contextvars.ContextVar("fold_spec_attention", default=None)   # set only inside attention_swapped


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    return _ACTIVE.get()(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def attention_swapped(target, fn):
    """The one attention swap: ``target``'s attention runs ``fn`` inside the block (registered once
    as transformers' ``"fold"`` implementation, with no mask of its own; the previous one restored)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("fold", _dispatch)
    AttentionMaskInterface.register("fold", lambda *args, **kwargs: None)        # the caller's read masks
    previous = target.config._attn_implementation
    token = _ACTIVE.set(fn)
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


@functools.lru_cache(maxsize=None)
def _register_grouped() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("fold_gqa", _grouped_dispatch)
    AttentionMaskInterface.register("fold_gqa", AttentionMaskInterface._global_mapping["sdpa"])


def _grouped_dispatch(*args, **kwargs):
    return grouped_sdpa(*args, **kwargs)            # looked up per call, so the function stays patchable


@contextlib.contextmanager
def grouped_verification(target):
    """Within the block, a target on transformers' ``"sdpa"`` attention runs :func:`grouped_sdpa`
    (registered as ``"fold_gqa"``, with SDPA's masks); any other implementation is left alone."""
    previous = target.config._attn_implementation
    if previous != "sdpa" or not getattr(target, "_supports_attention_backend", False):
        yield
        return
    _register_grouped()
    target.set_attn_implementation("fold_gqa")
    try:
        yield
    finally:
        target.set_attn_implementation(previous)


def _replay_linear(target, replay: _Replay, cache, index: int, keep: int) -> None:
    """Put linear-attention layer ``index`` back to its state before the verification, then run the
    verification's first ``keep`` rows through that layer's mixer again."""
    layer = cache.layers[index]
    conv, recurrent = replay.snapshots[index]
    layer.conv_states[0] = conv
    layer.recurrent_states[0].copy_(recurrent)
    if keep:
        decoder = decoder_layers(target)[index]
        x = decoder.input_layernorm(replay.hidden_states[index][:, :keep])
        decoder.linear_attn(x, **{_cache_kwarg(type(decoder.linear_attn).forward): cache})
    layer.conv_states[0] = layer.conv_states[0][..., -layer.conv_kernel_size[0]:]


def _crop(target, cache, length: int, replay) -> None:
    layers = _layers(cache)
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
        kind = _layer_kind(layer)
        if kind == "linear":
            if removed and (replay is None or i not in replay.snapshots):
                raise RuntimeError(f"linear-attention layer {i}: no state saved before the last forward, so its "
                                   "recurrent state cannot be rolled back")
            if removed:
                _replay_linear(target, replay, cache, i, replay.new_tokens - removed)
            elif layer.conv_states[0] is not None:
                layer.conv_states[0] = layer.conv_states[0][..., -layer.conv_kernel_size[0]:]
        elif kind == "sliding":
            layer.crop(-removed)                              # crop(0) shrinks back to the window
        elif kind == "full" and removed:
            layer.crop(-removed)


def _keep_tree_path(cache, n_tree: int, kept) -> None:
    kept = torch.as_tensor(kept)
    layers = _layers(cache)
    if not layers:                                            # transformers 4.x
        for i in range(len(cache.key_cache)):
            n_old = cache.key_cache[i].shape[2] - n_tree
            idx = torch.cat([torch.arange(n_old), n_old + kept]).to(cache.key_cache[i].device)
            cache.key_cache[i] = cache.key_cache[i].index_select(2, idx)
            cache.value_cache[i] = cache.value_cache[i].index_select(2, idx)
        return
    for layer in layers:
        kind = _layer_kind(layer)
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


def key_layer(cache, index: int, layer_types) -> int:
    """The cache layer holding the keys that layer ``index`` reads: itself, or for a KV-sharing
    consumer (Gemma-4's ``num_kv_shared_layers``) the last earlier layer of its type that stores them."""
    layers = _layers(cache)
    if not layers or _layer_kind(layers[index]) != "none":
        return index
    return max(i for i in range(index) if layer_types[i] == layer_types[index] and _layer_kind(layers[i]) != "none")


def layer_values(cache, index: int):
    """Values of layer ``index`` of a dynamic cache, ``[B, Hkv, T, d]``."""
    if hasattr(cache, "layers"):
        return cache.layers[index].values
    return cache.value_cache[index]


# -- a target layer's query, for target-side retrieval (CMR) ------------------------------------------

@torch.no_grad()
def attention_query(target, index: int, hidden_in, positions):
    """The rotated query of attention layer ``index`` for rows whose layer input is ``hidden_in
    [1, T, H]`` at ``positions [T]`` -> ``(q [1, Hq, T, d], scaling)``, exactly as the layer computes
    it (its norms, gate split, partial or proportional RoPE), read through ``AttentionInterface``."""
    layer = decoder_layers(target)[index]
    attn = layer.self_attn
    x = layer.input_layernorm(hidden_in)
    rotary = target.model.rotary_emb
    pos = positions.view(1, -1).to(x.device)
    types = _target_layer_types(target)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        embeddings = rotary(x, pos, layer_type=types[index] if types else "full_attention")
    else:
        embeddings = rotary(x, pos)
    kwargs = dict(hidden_states=x, position_embeddings=embeddings, attention_mask=None)
    if "shared_kv_states" in inspect.signature(type(attn).forward).parameters:   # only the query is read
        kwargs["shared_kv_states"] = dict.fromkeys(set(types) or {"full_attention"}, (None, None))
    captured = []

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured.append((query, scaling))
        return query.transpose(1, 2), None                  # [B, T, Hq, d], the shape the layer expects

    with attention_swapped(target, capture):
        attn(**kwargs)
    query, scaling = captured.pop()
    return query, (scaling if scaling is not None else attn.scaling)
