"""vLLM's DFlash / DSpark drafter classes with their attention layers served by fold.

Each class here subclasses vLLM's own (:data:`fold.vllm.compat.DRAFTERS`) and, after vLLM built it,
hands every drafter attention layer to :class:`fold.vllm.backend.FoldAttentionBackend` when the
drafter's config.json asks for a fold read. Nothing of vLLM's forward is patched: queries and keys are
rotated by vLLM as always, and only the layer's backend (its read and its cache layout) changes.
:func:`check_engine_config` runs the config-level checks in the process the user started.
"""

from __future__ import annotations

import importlib
import logging

import torch

import fold
from fold.vllm import compat
from fold.vllm.backend import CACHE_DTYPES, NAME, FoldAttentionBackend, FoldAttentionImpl
from fold.vllm.config import read_of

logger = logging.getLogger("fold.vllm")


def _table_inv_freq(rotary_emb) -> torch.Tensor:
    """The inverse frequencies vLLM forms ``rotary_emb``'s cos/sin table with (float32). Linear
    scaling divides the positions (``t / s``), dynamic NTK raises the base once (for the longest
    length, or by ``alpha``), YaRN blends with its scaling factor; default, Llama-3 and static NTK take
    the base. Whatever the class, :func:`rope_of` then checks the table against these."""
    kind = type(rotary_emb).__name__
    if kind == "YaRNScalingRotaryEmbedding":
        return rotary_emb._compute_inv_freq(rotary_emb.scaling_factor)
    if kind == "LinearScalingRotaryEmbedding":
        factors = rotary_emb.scaling_factors
        if len(factors) != 1:
            raise ValueError(f"fold: a linear-scaling rotary embedding with several factors {factors} holds one "
                             "table per factor; fold reads one")
        return rotary_emb._compute_inv_freq(rotary_emb.base) / factors[0]
    if kind == "DynamicNTKAlphaRotaryEmbedding":
        dim = rotary_emb.rotary_dim
        return rotary_emb._compute_inv_freq(rotary_emb.base * rotary_emb.scaling_alpha ** (dim / (dim - 2)))
    if kind == "DynamicNTKScalingRotaryEmbedding":
        dim, factor = rotary_emb.rotary_dim, rotary_emb.scaling_factor
        grown = factor * rotary_emb.max_position_embeddings / rotary_emb.max_trained_positions - (factor - 1)
        return rotary_emb._compute_inv_freq(rotary_emb.base * grown ** (dim / (dim - 2)))
    return rotary_emb._compute_inv_freq(rotary_emb.base)


def is_nope(rotary_emb) -> bool:
    """A layer whose "rotary embedding" rotates nothing: vLLM 0.34's ``_NoRope`` (Ricursive DFlash 2's
    NoPE layers), which keeps the wrapped rotary's ``cos_sin_cache`` for a fused precompute."""
    return type(rotary_emb).__name__ == "_NoRope"


def rope_of(rotary_emb) -> fold.Rope:
    """The :class:`fold.Rope` that reproduces a vLLM rotary embedding, checked against its cos/sin table
    (``[positions, rotary_dim]``: cos then sin, times the embedding's scale) as vLLM forms it in float32
    (:meth:`_compute_cos_sin_cache`), and that table against the one it serves (in the model's dtype,
    at that dtype's precision)."""
    refused = ValueError(f"fold cannot reproduce this drafter's rotary embedding ({type(rotary_emb).__name__}): "
                         "its cos/sin cache is not cos/sin(position x inv_freq) times one scale")
    served = rotary_emb.cos_sin_cache.detach()
    size = served.shape[0]
    positions = torch.tensor(sorted({0, 1, 7, 1000 % size, size // 2, size - 1}))
    try:        # a class whose table takes more than positions (LongRoPE), or without vLLM's formula, is refused
        inv_freq = _table_inv_freq(rotary_emb).to(torch.float32)
        table = rotary_emb._compute_cos_sin_cache().detach()[positions].to("cpu", torch.float64)   # vLLM's formula
    except (TypeError, AttributeError) as exc:
        raise refused from exc
    served = served[positions.to(served.device)].to("cpu", torch.float64)
    factor = float(table[0, 0])                                                        # cos(0) x scale
    rope = fold.Rope(inv_freq, rotary_dim=rotary_emb.rotary_dim, interleaved=not rotary_emb.is_neox_style,
                     attention_factor=factor)
    angle = positions[:, None].double() * inv_freq.double()[None, :]
    want = torch.cat((torch.cos(angle), torch.sin(angle)), dim=-1) * factor
    # vLLM forms the angles in float32: its table drifts by ~1e-7 x position from the float64 angles
    tolerance = (1e-5 + 1e-7 * positions.double())[:, None] * factor
    eps = torch.finfo(rotary_emb.cos_sin_cache.dtype).eps
    shape_ok = table.shape[1] == rotary_emb.rotary_dim == served.shape[1]
    if not shape_ok or bool(((table - want).abs() > tolerance).any()) or bool(
            ((served - table).abs() > eps * factor + 1e-6).any()):
        raise refused
    return rope


def cache_dtype_of(name: str) -> str:
    """A drafter cache dtype fold serves (``ValueError`` naming it otherwise)."""
    if name not in CACHE_DTYPES:
        raise ValueError(f"fold: the drafter's kv_cache_dtype {name!r} is not served; fold's backend takes "
                         f"{list(CACHE_DTYPES)} (set speculative_config['kv_cache_dtype'] for the drafter alone)")
    return name


def install(model: torch.nn.Module, vllm_config) -> int:
    """Serve ``model``'s drafter attention layers by fold if its config asks; returns how many layers."""
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    read = read_of(hf_config)
    if not read.active:
        return 0
    # V2's speculators hand their model a config whose decode_context_parallel_size is the draft's
    # (speculative_config.draft_decode_context_parallel_size); V1 reads the engine's
    dcp = getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1
    if dcp > 1:
        raise ValueError(f"fold: decode context parallelism ({dcp} ranks) splits each request's drafter cache "
                         "across ranks, and fold's read needs its entries in order on one rank; set "
                         "speculative_config draft_decode_context_parallel_size=1")
    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(getattr(module, "attn", None), compat.Attention) and hasattr(module, "rotary_emb")]
    # a NoPE layer (0.34's Ricursive DFlash 2 wraps the rotary in an identity, _NoRope, that keeps the real
    # cos/sin table): its keys are never rotated and it has no positions for fold to remap, so it keeps
    # vLLM's own read (a table check alone would take it for a rotary layer and un-rotate its keys)
    layers = [(name, module) for name, module in layers if not is_nope(module.rotary_emb)]
    if not layers:
        raise ValueError(f"fold: found no attention layer with a rotary embedding in {type(model).__name__}")
    for name, module in layers:
        attn, impl = module.attn, module.attn.impl
        if module.rotary_emb is None:
            raise ValueError(f"fold: drafter layer {name} has no rotary embedding; fold's read needs one")
        # the module's own window (DFlash, Laguna), else the one its Attention was built with (Gemma-4 DSpark)
        sliding = getattr(module, "sliding_window", None) or getattr(attn, "sliding_window", None)
        if sliding is not None and sliding < vllm_config.speculative_config.num_speculative_tokens + 1:
            raise ValueError(f"fold: drafter layer {name}'s sliding window {sliding} is shorter than the draft block")
        causal = getattr(module, "causal", None)
        if causal is None:
            causal = _config_causal(hf_config)
        if causal is None:
            raise ValueError(f"fold: cannot tell whether drafter layer {name} ({type(module).__name__}) reads its block "
                             "causally; state it in the drafter config (is_causal or dflash_config.causal)")
        sinks = getattr(module, "attention_sink_bias", None)
        if sinks is None:                                   # sinks kept under another name (Laguna's "sink")
            sinks = getattr(impl, "sinks", None)
        attn.impl = FoldAttentionImpl(impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads, read=read,
                                      rope=rope_of(module.rotary_emb), sinks=sinks,
                                      kv_cache_dtype=cache_dtype_of(getattr(attn, "kv_cache_dtype", "auto")),
                                      sliding_window=sliding, causal=bool(causal),
                                      softcap=getattr(impl, "logits_soft_cap", None))
        attn.attn_backend = FoldAttentionBackend
        attn.backend = compat.AttentionBackendEnum[NAME]
        # vLLM frees a sliding layer's pages once they leave its window; FOLD reads them as far memory,
        # so the layer asks for a full-attention cache (its read still applies the window)
        attn.sliding_window = None
    return len(layers)


def hand_context_positions(model: torch.nn.Module) -> None:
    """Let fold's layers see the positions of the context keys the DFlash precompute writes.

    vLLM's ``precompute_and_store_context_kv(states, positions, slot_mapping)`` writes each layer's
    context keys, rotated at ``positions``, through ``do_kv_cache_update``, which is not handed the
    positions; fold's cache holds keys un-rotated (and the far-page bounds are of those keys), so each
    fold layer is given them for the duration of the call (:attr:`FoldAttentionImpl.context_positions`).
    On V1 (0.32, 0.33) the precompute runs outside CUDA graphs; V2's DFlash speculator (0.33, 0.34) captures it inside the full
    draft graph, so what runs here is plain Python around the call, setting a reference to vLLM's own
    persistent ``positions`` buffer, and the write it wraps reads no tensor on the host."""
    impls = [m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), FoldAttentionImpl)]
    for owner in {id(o): o for o in (model, getattr(model, "model", None)) if o is not None}.values():
        precompute = getattr(owner, "precompute_and_store_context_kv", None)
        if precompute is None or getattr(precompute, "_fold_positions", False):
            continue

        def wrapped(states, positions, *args, _precompute=precompute, **kwargs):
            for impl in impls:
                impl.context_positions = positions
            try:
                return _precompute(states, positions, *args, **kwargs)
            finally:
                for impl in impls:
                    impl.context_positions = None
        wrapped._fold_positions = True
        owner.precompute_and_store_context_kv = wrapped


def _config_causal(hf_config) -> bool | None:
    """A drafter config's own statement of its layers' causality (``is_causal``, ``dflash_config.causal``)."""
    stated = getattr(hf_config, "is_causal", None)
    if stated is None:
        stated = (getattr(hf_config, "dflash_config", None) or {}).get("causal")
    return None if stated is None else bool(stated)


def check_engine_config(vllm_config) -> None:
    """The drafter's ``fold`` block and cache dtype, checked where the engine's config is made (the
    process the user started, before the engine core): a ``ValueError`` naming the field is then the
    last thing the user sees. Past the drafter's ``max_position_embeddings`` vLLM drafts nothing for
    the whole batch: say so."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        return
    read = read_of(draft.hf_config)
    if not read.active:
        return
    cache_dtype_of(getattr(spec, "kv_cache_dtype", None) or vllm_config.cache_config.cache_dtype)
    block_size = getattr(vllm_config.cache_config, "block_size", None)
    if block_size is not None:                 # else the backend checks it against the cache's pages
        read.check_pages(block_size, getattr(spec, "num_speculative_tokens", 0) + 1)
    limit = getattr(draft.hf_config, "max_position_embeddings", None)
    if limit is not None and vllm_config.model_config.max_model_len > limit:
        logger.warning(
            "fold: max_model_len %d exceeds the drafter's max_position_embeddings %d; past position %d vLLM drafts "
            "nothing for the whole batch (every round verifies empty drafts). Raise it with "
            "fold.vllm.configure(..., max_model_len=%d, raise_max_position=True)",
            vllm_config.model_config.max_model_len, limit, limit, vllm_config.model_config.max_model_len)


_CLASSES: dict[str, type] = {}


def fold_class(arch: str) -> type:
    """The fold-served subclass of vLLM's class for drafter architecture ``arch``."""
    if arch not in _CLASSES:
        module, name = compat.available_drafters()[arch]
        base = getattr(importlib.import_module(module), name)

        def __init__(self, *, vllm_config, prefix: str = ""):
            base.__init__(self, vllm_config=vllm_config, prefix=prefix)
            if install(self, vllm_config):
                hand_context_positions(self)

        _CLASSES[arch] = type(f"Fold{arch}", (base,), {"__init__": __init__, "__module__": __name__})
    return _CLASSES[arch]


def __getattr__(name: str):
    # "fold.vllm.models:Fold<arch>" is what the plug-in registers (resolved lazily, in every process)
    if name.startswith("Fold") and name[4:] in compat.available_drafters():
        return fold_class(name[4:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
