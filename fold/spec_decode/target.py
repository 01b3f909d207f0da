"""What fold.spec_decode needs to know about a transformers target, found once: its API (cache keyword,
``logits_to_keep``), its head, whether its attention can be swapped, its layer types; and the
targets the loop refuses."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


def decoder_layers(target):
    """The target's decoder layers (``target.model.layers``)."""
    model = getattr(target, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(target).__name__} has no .model.layers; fold.spec_decode needs a decoder-only causal LM")
    return layers


def layer_types(target) -> tuple[str, ...]:
    """``config.layer_types`` of the target's text config (empty when it has none: all full attention)."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return tuple(getattr(config, "layer_types", None) or ())


# transformers' private names, read in this one place: it offers no public getter for either
def attn_implementation(target) -> str:
    """The attention implementation the target runs now (``config._attn_implementation``)."""
    return target.config._attn_implementation


def dispatches_attention(target) -> bool:
    """Whether the target's attention goes through ``AttentionInterface`` (``_supports_attention_backend``)."""
    return bool(getattr(target, "_supports_attention_backend", False))


def cache_kwarg(forward) -> str:
    """The keyword a ``forward`` takes its cache by (transformers 4.x and 5.x differ, so do mixers)."""
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else "cache_params"


@dataclass(frozen=True)
class TargetFacts:
    """Facts about one target, probed once (:meth:`probe`) and owned by the sessions that use it.

    ``cache_kwarg``: the keyword its forward takes the cache by; ``logits_to_keep``: its forward takes
    ``logits_to_keep``; ``plain_head``: its logits are exactly its output embeddings applied to the
    last hidden state (no soft-capping, scale or bias), so a row can be computed when read
    (:class:`fold.spec_decode.session.LogitRows`; probed on a CPU only, where a head's cost follows its rows);
    ``swappable``: its attention dispatches through transformers' ``AttentionInterface``;
    ``layer_types``: ``config.layer_types``."""

    cache_kwarg: str
    logits_to_keep: bool
    plain_head: bool
    swappable: bool
    layer_types: tuple[str, ...]

    @classmethod
    @torch.no_grad()
    def probe(cls, target) -> TargetFacts:
        forward = type(target).forward
        device = next(target.parameters()).device
        plain = False
        head = target.get_output_embeddings()
        config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        if device.type == "cpu" and isinstance(head, torch.nn.Linear) and not getattr(
                config, "final_logit_softcapping", None):
            # a forward of a few tokens drawn from the vocabulary, no cache (logits of a realistic size, so
            # a transform after the head shows): the same product on the same rows, compared bit for bit
            ids = torch.randint(0, head.out_features, (1, 8), generator=torch.Generator().manual_seed(0))
            out = target(ids.to(device), use_cache=False, output_hidden_states=True)
            plain = torch.equal(head(out.hidden_states[-1]), out.logits)
        return cls(cache_kwarg(forward), "logits_to_keep" in inspect.signature(forward).parameters, plain,
                   dispatches_attention(target), layer_types(target))


def check_target(target, *, tree: bool = False) -> None:
    """Refuse, by name and before any work, a target whose cache the loop cannot roll back or,
    with ``tree``, cannot verify a token tree in."""
    types = layer_types(target)
    known = {"full_attention", "sliding_attention", "linear_attention"}
    unknown = sorted(set(types) - known)
    if unknown:
        raise ValueError(f"{type(target).__name__}: layer_types {unknown} are not supported by fold.spec_decode (it rolls "
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
