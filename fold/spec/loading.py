"""``spec.load_drafter``: z-lab DFlash and DeepSpec DFlash/DSpark checkpoint directories, offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import fold
from fold.spec.drafter import Drafter, DrafterConfig

KEY_ALIASES = {"midlayer.": "layers.0.", "encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default tap: evenly from layer 1 to ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _first(*values):
    return next((v for v in values if v is not None), None)


def _require(config: dict, name: str, path: Path):
    if name not in config:
        raise ValueError(f"{path}/config.json has no {name!r}")
    return config[name]


def read_config(path: Path, target_config) -> DrafterConfig:
    """Detect the format and resolve every field with the fallbacks seen across checkpoint revisions."""
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch == "DFlash2DraftModel":
        raise ValueError(f"{path}: DFlash2 checkpoints (DFlash2DraftModel: conv layers, candidate selector) "
                         "are not supported")
    dflash = config.get("dflash_config") or {}
    if arch == "DFlashDraftModel" or (arch is None and dflash):
        sample_from_anchor = False
    elif arch == "Qwen3DSparkModel":
        sample_from_anchor = True
    else:
        raise ValueError(f"{path}: unknown drafter architecture {arch!r}; supported: 'DFlashDraftModel' "
                         "(z-lab DFlash) and 'Qwen3DSparkModel' (DeepSpec DFlash / DSpark)")
    layer_types = config.get("layer_types") or []
    causal = _first(config.get("is_causal"), dflash.get("causal"))
    if "sliding_attention" in layer_types or dflash.get("use_swa") or causal:
        raise ValueError(f"{path}: drafters with sliding-window or causal layers (layer_types {layer_types}, "
                         f"is_causal/causal={causal}, use_swa={dflash.get('use_swa')}) are not supported yet; "
                         "every layer must be full, bidirectional attention")
    markov_rank = int(config.get("markov_rank") or 0) if sample_from_anchor else 0
    if markov_rank and config.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"{path}: DSpark markov_head_type {config['markov_head_type']!r} is not supported "
                         "(only 'vanilla', the released checkpoints' head)")
    hidden = _require(config, "hidden_size", path)
    heads_q = _require(config, "num_attention_heads", path)
    layers = _require(config, "num_hidden_layers", path)
    num_target_layers = _first(config.get("num_target_layers"), target_config.num_hidden_layers)
    ids = _first(dflash.get("target_layer_ids"), config.get("target_layer_ids"))
    if ids is None:
        ids = build_target_layer_ids(num_target_layers, layers)
    mask_id = _first(dflash.get("mask_token_id"), config.get("mask_token_id"))
    if mask_id is None:
        raise ValueError(f"{path}/config.json has no mask_token_id (neither dflash_config.mask_token_id nor top level)")
    import transformers

    rope_config = transformers.Qwen3Config(**{k: v for k, v in config.items()
                                              if k not in ("architectures", "dflash_config", "auto_map")})
    return DrafterConfig(
        hidden_size=hidden, intermediate_size=_require(config, "intermediate_size", path), num_layers=layers,
        heads_q=heads_q, heads_kv=config.get("num_key_value_heads", heads_q),
        head_dim=config.get("head_dim") or hidden // heads_q, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        attention_bias=bool(config.get("attention_bias", False)), vocab_size=_require(config, "vocab_size", path),
        block_size=int(_first(config.get("block_size"), dflash.get("block_size"), 16)),
        target_layer_ids=[int(i) for i in ids], mask_token_id=int(mask_id), sample_from_anchor=sample_from_anchor,
        markov_rank=markov_rank, has_embeddings=sample_from_anchor, rope=fold.Rope.from_config(rope_config),
    )


def _validate_against_target(cfg: DrafterConfig, target_config, path: Path) -> None:
    if cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"{path}: drafter hidden_size={cfg.hidden_size} != target hidden_size="
                         f"{target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"{path}: drafter vocab_size={cfg.vocab_size} != target vocab_size={target_config.vocab_size}")
    last = target_config.num_hidden_layers - 1
    bad = [i for i in cfg.target_layer_ids if not -1 <= i < last]
    if bad:
        raise ValueError(f"{path}: target_layer_ids {bad} out of range for a target of {last + 1} layers "
                         f"(output-of-layer ids in [-1, {last - 1}]; the last layer is never tapped)")


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors (or model.safetensors.index.json)")
    state = {}
    for name in files:
        state.update(load_file(str(path / name)))
    out = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        for old, new in KEY_ALIASES.items():
            if key.startswith(old):
                key = new + key[len(old):]
        out[key] = value
    return out


def _is_glide(path: Path, config: dict) -> bool:
    arch = " ".join(config.get("architectures") or [])
    if "Glide" in arch:
        return True
    index = path / "model.safetensors"
    if index.is_file():
        from safetensors import safe_open

        with safe_open(str(index), "pt") as f:
            return any(k.removeprefix("model.").startswith("cross_attn.") for k in f.keys())
    return False


def load_glide(path: Path, config: dict, target):
    """A LongSpec GLIDE directory: one decoder layer, the target's config, embedding and LM head."""
    import transformers

    from fold.spec.glide import GlideConfig, GlideDrafter

    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        _require(config, name, path)
    heads_q = config["num_attention_heads"]
    heads_kv = config.get("num_key_value_heads", heads_q)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads_q
    model_type = config.get("model_type", target.config.model_type)
    rope_config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items()
                                                                   if k not in ("architectures", "model_type")})
    cfg = GlideConfig(hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
                      heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                      rms_norm_eps=config.get("rms_norm_eps", 1e-6), vocab_size=config["vocab_size"],
                      window=int(config.get("glide_window", 512)), rope=fold.Rope.from_config(rope_config))
    tc = target.config
    target_heads_kv = getattr(tc, "num_key_value_heads", tc.num_attention_heads)
    target_head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if cfg.hidden_size != tc.hidden_size:
        raise ValueError(f"{path}: drafter hidden_size={cfg.hidden_size} != target hidden_size={tc.hidden_size}")
    if cfg.vocab_size != tc.vocab_size:
        raise ValueError(f"{path}: drafter vocab_size={cfg.vocab_size} != target vocab_size={tc.vocab_size}")
    if (heads_kv, head_dim) != (target_heads_kv, target_head_dim):
        raise ValueError(f"{path}: GLIDE cross-attention reads the target's KV cache, so num_key_value_heads and "
                         f"head_dim must match the target's ({target_heads_kv}, {target_head_dim}); "
                         f"got ({heads_kv}, {head_dim})")
    drafter = GlideDrafter(cfg)
    state = {k: v for k, v in _load_weights(path).items() if not k.startswith("cross_attn.rotary")}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match a GLIDE layer: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    drafter.bind(target)
    return drafter.to(device=next(target.parameters()).device, dtype=next(target.parameters()).dtype).eval()


def load_drafter(path, target):
    """Load a drafter directory (``config.json`` + safetensors) for ``target`` (a transformers causal LM).

    Formats: z-lab DFlash (``DFlashDraftModel`` or a ``dflash_config`` block; the target's embedding
    and LM head are used) and DeepSpec DFlash/DSpark (``Qwen3DSparkModel``; shipped embedding/head,
    vanilla Markov head when ``markov_rank > 0``; a confidence head, if shipped, is not used).
    LongSpec GLIDE directories (a single decoder layer with ``self_attn`` and ``cross_attn``, the
    target's config) load as :class:`fold.spec.glide.GlideDrafter`. Unknown formats, DFlash2 and
    non-vanilla Markov heads are refused by name.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a drafter directory (no config.json)")
    raw = json.loads((path / "config.json").read_text())
    if _is_glide(path, raw):
        return load_glide(path, raw, target)
    cfg = read_config(path, target.config)
    _validate_against_target(cfg, target.config, path)
    drafter = Drafter(cfg)
    state = _load_weights(path)
    state = {k: v for k, v in state.items() if not k.startswith("confidence_head.")}
    fc = state.get("fc.weight")
    if fc is not None and fc.shape[1] != len(cfg.target_layer_ids) * target.config.hidden_size:
        raise ValueError(f"{path}: fc.weight takes {fc.shape[1]} features but {len(cfg.target_layer_ids)} tapped "
                         f"layers x hidden_size {target.config.hidden_size} = "
                         f"{len(cfg.target_layer_ids) * target.config.hidden_size}")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    drafter.bind(target)
    dtype = next(target.parameters()).dtype
    return drafter.to(device=next(target.parameters()).device, dtype=dtype).eval()
