"""FOLD inside z-lab's own loop: one call on an upstream DFlash drafter (``pip install --no-deps dflash``),
and ``dflash.model.dflash_generate`` drafts with FOLD's read, nothing else in the caller's code changed::

    handle = fold.spec_decode.use_fold(drafter, window=2048, alpha=2.0)
    out = dflash_generate(drafter, target, input_ids, 256, stop_token_ids)     # as before
    handle.remove()                                                            # the stock read again

How it reaches the read. Upstream's attention (``Qwen3DFlashAttention.forward``, DFlash and DFlash 2)
rotates q and k itself, appends them to its ``DynamicCache`` (context keys stay rotated at their own
positions) and calls ``ALL_ATTENTION_FUNCTIONS["sdpa"](self, q, k, v, mask, ...)`` by name, a name it
looks up in the module that defines it. :func:`use_fold` puts a lookup under that name there, in that
module only: for the drafter's own attention modules every name gives
``fold.attention(..., keys_rotated=True, queries_rotated=True)`` with the layer's sliding window and
causality (the paper's per-layer rule, as ``fold.spec_decode``'s ``policy="fold"``); for any other
module, the registry's own function. transformers' registry is untouched, and so is every target's
attention (the target's attention looks its functions up in its own module).

Upstream's draft cache keeps only the last ``sliding_window`` entries of a sliding layer, but FOLD reads
the older ones as far memory. So while FOLD is on, the drafter's ``config`` is a copy whose
``layer_types`` are all ``full_attention``: ``DynamicCache(config=drafter.config)`` then keeps every
entry, and the attention modules still apply their windows (built at load, from the original config),
as fold's local branch. :meth:`FoldHandle.remove` puts the original config back.

The read assumes what ``dflash_generate`` does: the cache holds the drafter's context from position 0,
the block's rows last; the mask upstream builds from the layer's rule is not read (fold applies the
same rule itself).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from dataclasses import asdict

import fold
from fold.read_options import ReadOptions
from fold.spec_decode.policies import validate_options

LOOKUP_NAME = "ALL_ATTENTION_FUNCTIONS"
_LOOKUPS: dict[int, _Lookup] = {}           # id(module namespace) -> the lookup installed there


class _Lookup(Mapping):
    """What an upstream attention class's module sees as ``ALL_ATTENTION_FUNCTIONS``: the registry it
    had (every attribute passed on), except that a function it hands out sends the modules in
    ``reads`` to their FOLD read."""

    def __init__(self, registry, namespace: dict):
        self.registry, self.namespace = registry, namespace
        self.reads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # attention module -> read

    def __getitem__(self, name):
        original = self.registry[name]
        reads = self.reads

        def route(module, *args, **kwargs):
            read = reads.get(module)
            return original(module, *args, **kwargs) if read is None else read(module, *args, **kwargs)
        return route

    def __iter__(self):
        return iter(self.registry)

    def __len__(self):
        return len(self.registry)

    def __getattr__(self, name):
        return getattr(self.registry, name)


class _FoldLayerRead:
    """One drafter's FOLD read, called in place of ``sdpa`` with transformers' attention signature."""

    def __init__(self, rope: fold.Rope, window: int, read: ReadOptions):
        self.rope, self.window, self.read = rope, window, read

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, **kwargs):
        # query [b, Hq, n_q, d] rotated at positions n .. n + n_q - 1; key/value [b, Hkv, n + n_q, d], every
        # entry from position 0, keys rotated at their own positions, the block's rows last
        out = fold.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), window=self.window,
                             rope=self.rope, keys_rotated=True, queries_rotated=True, softmax_scale=scaling,
                             sliding_window=module.sliding_window, causal=bool(module.is_causal), **asdict(self.read))
        return out, None                                                         # [b, n_q, Hq, d]


class FoldHandle:
    """What :func:`use_fold` returns: :meth:`remove` (or leaving a ``with`` block) turns FOLD off again."""

    def __init__(self, drafter, config, hooked: list[tuple]):
        self._drafter, self._config, self._hooked = drafter, config, hooked      # [(attention module, lookup)]

    def remove(self) -> None:
        """The stock read and the drafter's own config again; a second call does nothing."""
        if self._drafter is None:
            return
        for module, lookup in self._hooked:
            lookup.reads.pop(module, None)
            if not lookup.reads and lookup.namespace.get(LOOKUP_NAME) is lookup:     # the last drafter there
                lookup.namespace[LOOKUP_NAME] = lookup.registry
                _LOOKUPS.pop(id(lookup.namespace), None)
        self._drafter.config = self._config
        self._drafter = self._config = self._hooked = None

    def __enter__(self) -> FoldHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _attention_modules(drafter) -> list:
    """The drafter's attention modules, each of a class that looks ``ALL_ATTENTION_FUNCTIONS`` up by name."""
    layers = getattr(drafter, "layers", None)
    modules = [getattr(layer, "self_attn", None) for layer in layers] if layers is not None else []
    if not modules or any(m is None for m in modules) or not hasattr(drafter, "config"):
        raise TypeError(f"drafter must be an upstream DFlash drafter (dflash.model.DFlashDraftModel or "
                        f"DFlash2DraftModel: .config and .layers[i].self_attn), got {type(drafter).__name__}")
    for m in modules:
        forward = type(m).forward
        missing = [a for a in ("sliding_window", "is_causal", "scaling") if not hasattr(m, a)]
        if missing or LOOKUP_NAME not in getattr(getattr(forward, "__code__", None), "co_names", ()):
            raise TypeError(f"drafter's attention {type(m).__name__} is not upstream DFlash's (it must call "
                            f"{LOOKUP_NAME}[...] by name and hold sliding_window, is_causal, scaling); "
                            f"missing {missing or [LOOKUP_NAME]}")
    return modules


def _lookup_for(module) -> _Lookup:
    """The lookup in the namespace ``module``'s forward reads its globals from (installed once)."""
    namespace = type(module).forward.__globals__
    lookup = _LOOKUPS.get(id(namespace))
    if lookup is None or namespace.get(LOOKUP_NAME) is not lookup:
        if LOOKUP_NAME not in namespace:
            raise TypeError(f"{type(module).__module__} defines no {LOOKUP_NAME}; use_fold needs upstream DFlash's "
                            "attention, which looks its attention function up there")
        lookup = _LOOKUPS[id(namespace)] = _Lookup(namespace[LOOKUP_NAME], namespace)
        namespace[LOOKUP_NAME] = lookup
    return lookup


def use_fold(drafter, *, window: int = 2048, alpha: float = 2.0, backend: str = "auto") -> FoldHandle:
    """Turn FOLD on for an upstream DFlash / DFlash 2 drafter (``dflash.model``), in place.

    Every later ``dflash_generate(drafter, ...)`` (or ``drafter.spec_generate``) then reads the drafter's
    context as ``fold.spec_decode.generate(..., policy="fold", window=window, alpha=alpha)`` does: full layers
    by ``fold.attention`` (window ``W`` at exact positions, every older entry far memory at the shared
    position), sliding layers by their native window with every older entry far memory (the drafter's
    draft cache keeps them while FOLD is on). Only this drafter's attention changes: other drafters and
    the target keep theirs.

    Args:
        drafter: a ``dflash.model.DFlashDraftModel`` or ``DFlash2DraftModel``.
        window: W >= 0, context entries kept at exact positions (``fold.attention``'s). Default 2048.
        alpha: far-memory concentration in [1, 1e4]. Default 2.0.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"torch"`` or ``"triton"``.

    Returns:
        a :class:`FoldHandle`; ``handle.remove()`` (or leaving ``with use_fold(...):``) restores the
        stock read and the drafter's config.

    Example::

        >>> from dflash.model import DFlashDraftModel, dflash_generate
        >>> drafter = DFlashDraftModel.from_pretrained(path, dtype=torch.bfloat16).eval()
        >>> with fold.spec_decode.use_fold(drafter, window=2048, alpha=2.0):
        ...     out = dflash_generate(drafter, target, input_ids, 256, None)
    """
    modules = _attention_modules(drafter)
    options = validate_options(dict(window=window, alpha=alpha, backend=backend))
    read = _FoldLayerRead(fold.Rope.from_config(drafter.config), options["window"],
                          options["read"])                     # every check before anything is installed
    lookups = [_lookup_for(m) for m in modules]
    if any(m in lookup.reads for m, lookup in zip(modules, lookups)):
        raise ValueError("use_fold: this drafter already reads with FOLD; remove() its handle before a new call")
    original = drafter.config
    whole = copy.deepcopy(original)                    # the draft cache keeps every entry of every layer
    whole.layer_types = ["full_attention"] * len(modules)
    drafter.config = whole
    for m, lookup in zip(modules, lookups):
        lookup.reads[m] = read
    return FoldHandle(drafter, original, list(zip(modules, lookups)))
