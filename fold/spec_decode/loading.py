"""``spec_decode.load_drafter``: z-lab DFlash and DeepSpec DFlash/DSpark checkpoint directories, offline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

import fold
from fold.checks import check_float, check_int, is_int
from fold.rope import theta_inv_freq
from fold.spec_decode.drafter import Drafter, DrafterConfig

DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel", "Gemma4DSparkModel")
KEY_ALIASES = {"midlayer.": "layers.0.", "encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default tap: evenly from layer 1 to ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _first(*values):
    return next((v for v in values if v is not None), None)


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; unreadable, invalid or non-object files are a ValueError naming it."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got a {type(data).__name__}")
    return data


def _require(config: dict, name: str, path: Path):
    if config.get(name) is None:
        raise ValueError(f"{path}/config.json has no {name!r}")
    return config[name]


def _int(value, name: str, path: Path, minimum: int) -> int:
    return check_int(f"{path}/config.json: {name}", value, minimum, expected=f"an int >= {minimum}")


def _number(value, name: str, path: Path, *, positive: bool = True) -> float:
    return check_float(f"{path}/config.json: {name}", value, 0 if positive else None, open_low=True,
                       expected=f"a finite number{' > 0' if positive else ''}")


def architecture(config: dict, path: Path) -> str | None:
    """``architectures[0]``; the field must be a list of strings."""
    archs = config.get("architectures")
    if archs is None:
        return None
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise TypeError(f"{path}/config.json: architectures must be a list of strings (e.g. [\"DFlashDraftModel\"]), "
                        f"got {archs!r}")
    return archs[0] if archs else None


def _dflash_config(config: dict, path: Path) -> dict:
    dflash = config.get("dflash_config")
    if dflash is None:
        return {}
    if not isinstance(dflash, dict):
        raise TypeError(f"{path}/config.json: dflash_config must be an object, got {dflash!r}")
    return dflash


def _layer_rules(config: dict, dflash: dict, layers: int, path: Path, zlab: bool):
    """Per layer ``(sliding window or None, causal)`` from ``layer_types``, ``sliding_window`` /
    ``use_sliding_window`` (or ``dflash_config.swa_window_size``) and ``is_causal`` (or
    ``dflash_config.causal``): a layer is causal over the block exactly when it is a sliding-window
    layer unless ``is_causal`` says otherwise; the window counts the current token. Where upstream
    DFlash (the trainer's code) and vLLM read a field differently, the checkpoint is refused naming
    both readings (``FAMILIES.md``, "Config fields read two ways")."""
    where = f"{path}/config.json"
    types = config.get("layer_types")
    if types is None:
        types = ["full_attention"] * layers
    if not (isinstance(types, list) and len(types) == layers
            and all(t in ("full_attention", "sliding_attention") for t in types)):
        raise ValueError(f"{where}: layer_types must list 'full_attention' / 'sliding_attention' for each of the "
                         f"{layers} layers (num_hidden_layers), got {types!r}")
    if dflash.get("use_swa"):
        raise ValueError(f"{where}: dflash_config.use_swa (every layer a non-causal sliding window, MiMo) is not "
                         "supported; list the sliding layers in layer_types instead")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and not zlab:
        raise ValueError(f"{where}: layer_types {types} has sliding_attention layers, but DeepSpec drafters read "
                         "every layer as full, bidirectional attention")
    window = _sliding_window(config, dflash, path) if any(sliding) else None
    return [window if s else None for s in sliding], _layer_causal(config, dflash, sliding, path, zlab)


def _sliding_window(config: dict, dflash: dict, path: Path) -> int:
    """The sliding layers' window. Upstream DFlash builds a ``Qwen3Config``: ``sliding_window`` (4096
    when absent) if ``use_sliding_window`` is true, else no window at all (the layer reads in full);
    vLLM takes ``dflash_config.swa_window_size`` first. Either disagreement is refused."""
    where = f"{path}/config.json"
    qwen = config.get("model_type", "qwen3") in ("qwen3", "qwen2")
    swa = dflash.get("swa_window_size")
    swa = None if swa is None else _int(swa, "dflash_config.swa_window_size", path, 1)
    use = config.get("use_sliding_window")
    if qwen and use is not True:
        extra = "" if swa is None else f"; upstream DFlash reads no window at all, vLLM a window of {swa}"
        raise ValueError(f"{where}: layer_types has sliding_attention layers but use_sliding_window is {use!r}; a "
                         f"{config.get('model_type', 'qwen3')} config then drops sliding_window, and engines disagree "
                         f"on what such a layer reads{extra}")
    if swa is None:
        return _int(config.get("sliding_window"), "sliding_window", path, 1)
    upstream = config.get("sliding_window", 4096 if qwen else None)
    if upstream != swa:
        given = f"sliding_window={config['sliding_window']!r}" if "sliding_window" in config else \
            "no sliding_window (Qwen3Config's default is 4096)"
        raise ValueError(f"{where}: dflash_config.swa_window_size={swa} with {given}: upstream DFlash "
                         f"(DFlashDraftModel) reads the sliding layers' window as {upstream}, vLLM as {swa}; set "
                         "sliding_window to the window the drafter was trained with (and swa_window_size equal to "
                         "it or absent)")
    return swa


def _layer_causal(config: dict, dflash: dict, sliding: list[bool], path: Path, zlab: bool) -> list[bool]:
    """Per layer, causal over the block. Upstream DFlash reads ``is_causal`` for every layer, else a
    layer is causal when it slides, and never reads ``dflash_config.causal``; vLLM reads
    ``is_causal``, else ``dflash_config.causal``, for every layer; DeepSpec reads every layer
    bidirectionally."""
    where = f"{path}/config.json"
    stated, engines = config.get("is_causal"), dflash.get("causal")
    for value in (stated, engines):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{where}: is_causal / dflash_config.causal must be true or false, got {value!r}")
    if not zlab:
        return [False] * len(sliding)
    upstream = [s if stated is None else stated for s in sliding]
    if stated is None and engines is not None and any(c != engines for c in upstream):
        raise ValueError(f"{where}: dflash_config.causal={str(engines).lower()} without is_causal: upstream DFlash "
                         f"(DFlashDraftModel) ignores it and reads the layers as causal={upstream} (causal exactly "
                         f"when sliding), vLLM reads every layer as causal={engines}; set is_causal at the top level, "
                         "which both read first")
    if any(c and not s for c, s in zip(upstream, sliding)):
        raise ValueError(f"{where}: is_causal = true makes full-attention layers causal over the block, which "
                         "fold.spec_decode does not support (FOLD and the baselines read a full layer's block "
                         "bidirectionally)")
    return upstream


def _gemma4_rope(config: dict, target_config, head_dim: int, path: Path) -> fold.Rope:
    """The target's full-attention RoPE: proportional (rotated frequencies over ``head_dim``, the
    rest zero, i.e. unrotated), or default; from the drafter's (or else the target's) rope_parameters."""
    params = config.get("rope_parameters") or getattr(target_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if not isinstance(params, dict) or params.get("rope_theta") is None:
        raise ValueError(f"{path}/config.json: rope_parameters (['full_attention']) must give rope_theta")
    theta = _number(params["rope_theta"], "rope_parameters.rope_theta", path)
    partial = _number(params.get("partial_rotary_factor", 1.0), "partial_rotary_factor", path)
    factor = _number(params.get("factor", 1.0), "rope_parameters.factor", path)
    rope_type = params.get("rope_type", "default")
    if rope_type == "proportional":             # transformers' _compute_proportional_rope_parameters
        angles = int(partial * head_dim // 2)
        inv_freq = torch.cat([theta_inv_freq(theta, head_dim, angles), torch.zeros(head_dim // 2 - angles)]) / factor
        return fold.Rope(inv_freq, rotary_dim=head_dim)
    if rope_type == "default" and factor == 1.0:
        return fold.Rope.from_theta(theta, head_dim, rotary_dim=int(head_dim * partial))
    raise ValueError(f"{path}/config.json: rope_type {rope_type!r} of the full-attention layers is not supported "
                     "(proportional or default)")


def _qwen3_rope(config: dict, path: Path) -> fold.Rope:
    import transformers

    try:
        rope_config = transformers.Qwen3Config(**{k: v for k, v in config.items()
                                                  if k not in ("architectures", "dflash_config", "auto_map")})
        return fold.Rope.from_config(rope_config)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}/config.json: cannot build the drafter's RoPE from its fields ({e})") from None


def _drafter_format(config: dict, path: Path) -> tuple[str, dict]:
    """``("zlab" | "DFlash2DraftModel" | "Qwen3DSparkModel" | "Gemma4DSparkModel", dflash_config)``; anything
    else is refused by name."""
    arch = architecture(config, path)
    dflash = _dflash_config(config, path)
    if arch == "DFlash2DraftModel":
        return arch, dflash
    if arch == "DFlashDraftModel" or (arch is None and dflash):
        return "zlab", dflash
    if arch in ("Qwen3DSparkModel", "Gemma4DSparkModel"):
        return arch, dflash
    if arch is not None and arch.endswith(("ForCausalLM", "LMHeadModel")):
        raise ValueError(f"{path} is a target model ({arch}), not a drafter: a drafter directory holds a z-lab "
                         "DFlash ('DFlashDraftModel' or a dflash_config block), a DeepSpec DFlash/DSpark "
                         "('Qwen3DSparkModel', 'Gemma4DSparkModel') or a LongSpec GLIDE layer; pass this one as "
                         "the target")
    raise ValueError(f"{path}: unknown drafter architecture {arch!r}; supported: 'DFlashDraftModel' "
                     "(z-lab DFlash), 'DFlash2DraftModel' (z-lab DFlash 2), 'Qwen3DSparkModel' and "
                     "'Gemma4DSparkModel' (DeepSpec DFlash / DSpark)")


def _gemma4_fields(config: dict, target_config, hidden: int, path: Path) -> dict:
    """The ``DrafterConfig`` fields of DeepSpec's ``Gemma4DSparkModel`` block beyond the common ones."""
    # DeepSpec builds this config from a copy of the target's, so fields of the target's own
    # layers come along (hidden_size_per_layer_input, vocab_size_per_layer_input): the block
    # reads neither, and they are ignored here as there. A MoE block would change the layers.
    if config.get("enable_moe_block"):
        raise ValueError(f"{path}/config.json: enable_moe_block={config['enable_moe_block']!r} is not supported "
                         "by Gemma4DSparkModel (DeepSpec's block has no MoE)")
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{path}/config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    head_dim = _int(_require(config, "global_head_dim", path), "global_head_dim", path, 2)
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    kv_name = "num_global_key_value_heads" if k_eq_v else "num_key_value_heads"
    heads_kv = _int(_require(config, kv_name, path), kv_name, path, 1)
    cap = config.get("final_logit_softcapping")
    return dict(heads_kv=heads_kv, head_dim=head_dim, style="gemma4", softmax_scale=1.0,
                embed_scale=math.sqrt(hidden), k_eq_v=k_eq_v, hidden_act=act,
                logit_softcap=None if cap is None else _number(cap, "final_logit_softcapping", path),
                rope=_gemma4_rope(config, target_config, head_dim, path))


def _zlab_field(config: dict, dflash: dict, name: str, default=None):
    """``(value, where)`` of a z-lab field as upstream DFlash reads it (``dflash/model.py``'s
    ``_draft_value``): ``dflash_config``'s when it has the key, else the top level's, else ``default``."""
    if name in dflash:
        return dflash[name], f"dflash_config.{name}"
    return config.get(name, default), name


def _softcap(value, name: str, path: Path) -> float | None:
    """A z-lab ``final_logit_softcapping``: none when null or 0 (upstream applies it only above 0)."""
    if value is None:
        return None
    cap = _number(value, name, path, positive=False)
    if cap < 0:
        raise ValueError(f"{path}/config.json: {name}={value!r} is negative: upstream DFlash reads a cap <= 0 as no "
                         f"softcap, tanh(x / c) * c as a cap of {-cap:g}; give 0 or null for none, or a positive cap")
    return cap or None


def _qwen3_fields(config: dict, dflash: dict, hidden: int, heads_q: int, path: Path, zlab: bool) -> dict:
    """The ``DrafterConfig`` fields of a Qwen3-style block (z-lab DFlash / DFlash 2, DeepSpec
    ``Qwen3DSparkModel``). A z-lab drafter's scale, multiplier and softcap sit in ``dflash_config`` or
    at the top level (:func:`_zlab_field`); DeepSpec's in ``dflash_config`` only."""
    def field(name, default=None):
        if zlab:
            return _zlab_field(config, dflash, name, default)
        return dflash.get(name, default), f"dflash_config.{name}"
    heads_kv = _int(config.get("num_key_value_heads", heads_q), "num_key_value_heads", path, 1)
    head_dim = _int(config.get("head_dim") or hidden // heads_q, "head_dim", path, 2)
    cap, cap_name = field("final_logit_softcapping")
    if zlab:
        cap = _softcap(cap, cap_name, path)
    elif cap is not None:
        cap = _number(cap, cap_name, path)
    return dict(heads_kv=heads_kv, head_dim=head_dim, rope=_qwen3_rope(config, path),
                embed_scale=_number(*field("input_embedding_scale", 1.0), path),
                logit_multiplier=_number(*field("output_multiplier", 1.0), path), logit_softcap=cap)


DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _dflash2_fields(config: dict, dflash: dict, hidden: int, vocab: int, path: Path) -> dict:
    """A ``DFlash2DraftModel``'s convolution and selector sizes (``dflash_config`` first, as upstream)."""
    out = {}
    for name in DFLASH2_FIELDS:
        value, where = _zlab_field(config, dflash, name)
        if value is None:
            raise ValueError(f"{path}/config.json: a DFlash2DraftModel needs {name} (in dflash_config or at the "
                             "top level)")
        out[name] = _int(value, where, path, 1)
    if hidden % out["conv_group_size"]:
        raise ValueError(f"{path}/config.json: conv_group_size={out['conv_group_size']} must divide "
                         f"hidden_size={hidden} (one dynamic coefficient per group of channels)")
    if out["selector_top_k"] > vocab:
        raise ValueError(f"{path}/config.json: selector_top_k={out['selector_top_k']} exceeds vocab_size={vocab}")
    return out


def read_config(path: Path, target_config) -> DrafterConfig:
    """Detect the format and resolve every field with the fallbacks seen across checkpoint revisions."""
    config = read_json(path / "config.json")
    fmt, dflash = _drafter_format(config, path)
    deepspec = fmt not in ("zlab", "DFlash2DraftModel")
    gemma = fmt == "Gemma4DSparkModel"
    markov_rank = _int(config.get("markov_rank") or 0, "markov_rank", path, 0) if deepspec else 0
    if markov_rank and config.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"{path}: DSpark markov_head_type {config['markov_head_type']!r} is not supported "
                         "(only 'vanilla', the released checkpoints' head)")
    hidden = _int(_require(config, "hidden_size", path), "hidden_size", path, 1)
    heads_q = _int(_require(config, "num_attention_heads", path), "num_attention_heads", path, 1)
    layers = _int(_require(config, "num_hidden_layers", path), "num_hidden_layers", path, 1)
    inter = _int(_require(config, "intermediate_size", path), "intermediate_size", path, 1)
    vocab = _int(_require(config, "vocab_size", path), "vocab_size", path, 1)
    num_target_layers = _first(config.get("num_target_layers"), target_config.num_hidden_layers)
    ids = _first(dflash.get("target_layer_ids"), config.get("target_layer_ids"))
    if ids is None:
        ids = build_target_layer_ids(_int(num_target_layers, "num_target_layers", path, 1), layers)
    if not (isinstance(ids, list) and ids and all(is_int(i) for i in ids)):
        raise TypeError(f"{path}/config.json: target_layer_ids must be a non-empty list of ints, got {ids!r}")
    mask_id = _first(dflash.get("mask_token_id"), config.get("mask_token_id"))
    if mask_id is None:
        raise ValueError(f"{path}/config.json has no mask_token_id (neither dflash_config.mask_token_id nor top level)")
    mask_id = _int(mask_id, "mask_token_id", path, 0)
    if mask_id >= vocab:
        raise ValueError(f"{path}/config.json: mask_token_id={mask_id} is outside the vocabulary "
                         f"(vocab_size={vocab})")
    if deepspec:
        block, block_name = _first(config.get("block_size"), dflash.get("block_size"), 16), "block_size"
    else:
        block, block_name = _zlab_field(config, dflash, "block_size", 16)
    block_size = _int(block, block_name, path, 1 if deepspec else 2)
    eps = _number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", path)
    windows, causal = _layer_rules(config, dflash, layers, path, zlab=not deepspec)
    common = dict(hidden_size=hidden, intermediate_size=inter, num_layers=layers, heads_q=heads_q,
                  rms_norm_eps=eps, attention_bias=bool(config.get("attention_bias", False)), vocab_size=vocab,
                  block_size=block_size, target_layer_ids=list(ids), mask_token_id=mask_id,
                  sample_from_anchor=deepspec, markov_rank=markov_rank, has_embeddings=deepspec,
                  layer_windows=windows, layer_causal=causal)
    if gemma:
        cfg = DrafterConfig(**common, **_gemma4_fields(config, target_config, hidden, path))
    else:
        dflash2 = _dflash2_fields(config, dflash, hidden, vocab, path) if fmt == "DFlash2DraftModel" else {}
        cfg = DrafterConfig(**common, **_qwen3_fields(config, dflash, hidden, heads_q, path, not deepspec), **dflash2)
    head_dim = cfg.head_dim
    if heads_q % cfg.heads_kv:
        raise ValueError(f"{path}/config.json: num_attention_heads={heads_q} must be a multiple of the key/value "
                         f"heads ({cfg.heads_kv})")
    if cfg.rope.rotary_dim > head_dim:
        raise ValueError(f"{path}/config.json: the RoPE rotates {cfg.rope.rotary_dim} dims but head_dim is {head_dim}")
    return cfg


def check_fits(cfg, target_config, where: str) -> None:
    """Raise ``ValueError``, prefixed by ``where``, unless a drafter's config (``DrafterConfig`` or
    GLIDE's) fits ``target_config``: hidden size and vocabulary, then the tapped layers (a block
    drafter) or the key/value geometry of the cache it cross-attends (GLIDE). Each message names the
    drafter's value and the target's."""
    if cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"{where}drafter hidden_size={cfg.hidden_size} != target hidden_size="
                         f"{target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"{where}drafter vocab_size={cfg.vocab_size} != target vocab_size={target_config.vocab_size}")
    ids = getattr(cfg, "target_layer_ids", None)
    if ids is not None:
        last = target_config.num_hidden_layers - 1
        bad = [i for i in ids if not -1 <= i < last]
        if bad:
            raise ValueError(f"{where}target_layer_ids {bad} out of range for a target of {last + 1} layers "
                             f"(output-of-layer ids in [-1, {last - 1}]; the last layer is never tapped)")
        return
    heads_kv = getattr(target_config, "num_key_value_heads", target_config.num_attention_heads)
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    if (cfg.heads_kv, cfg.head_dim) != (heads_kv, head_dim):
        raise ValueError(f"{where}GLIDE cross-attention reads the target's KV cache, so num_key_value_heads and "
                         f"head_dim must match the target's ({heads_kv}, {head_dim}); "
                         f"got ({cfg.heads_kv}, {cfg.head_dim})")


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not file.is_file():
        raise ValueError(f"{file}: missing (named by the checkpoint)")
    try:
        return load_file(str(file))
    except Exception as e:            # SafetensorError and OSError name no file; say which one
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(f, str) for f in weight_map.values())):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names, got {weight_map!r}")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors (or model.safetensors.index.json)")
    state = {}
    for name in files:
        state.update(_load_file(path / name))
    out = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        for old, new in KEY_ALIASES.items():
            if key.startswith(old):
                key = new + key[len(old):]
        out[key] = value
    return out


def _weight_names(path: Path) -> list[str]:
    """The tensor names of ``path/model.safetensors`` (its header only), or [] without that file."""
    weights = path / "model.safetensors"
    if not weights.is_file():
        return []
    from safetensors import safe_open

    try:
        with safe_open(str(weights), "pt") as f:
            return list(f.keys())
    except Exception as e:        # SafetensorError names no file
        raise ValueError(f"{weights}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def drafter_kind(path) -> str | None:
    """What drafter ``path`` holds, named for a message (``"a z-lab DFlash drafter (DFlashDraftModel)"``), or
    None when its ``config.json`` and weights name no drafter (from the config and the safetensors header:
    no weights are loaded)."""
    path = Path(path)
    config = read_json(path / "config.json")
    arch = architecture(config, path)
    names = _weight_names(path)
    if arch in DRAFTER_ARCHITECTURES or config.get("dflash_config") or "fc.weight" in names:
        return f"a DFlash/DSpark drafter ({arch or 'a dflash_config block'})"
    if "Glide" in (arch or "") or any(k.removeprefix("model.").startswith("cross_attn.") for k in names):
        return f"a LongSpec GLIDE drafter ({arch or 'cross_attn weights'})"
    return None


def check_target_dir(path) -> None:
    """Refuse, before any weights load, a target directory that holds a drafter, naming what it is."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a model directory (no config.json)")
    kind = drafter_kind(path)
    if kind is not None:
        raise ValueError(f"{path} is {kind}, not a target: a target directory holds a causal LM (config.json "
                         "naming e.g. LlamaForCausalLM, its weights, its tokenizer); pass this one as the drafter")


def _is_glide(path: Path, config: dict) -> bool:
    if "Glide" in (architecture(config, path) or ""):
        return True
    if architecture(config, path) in DRAFTER_ARCHITECTURES or config.get("dflash_config"):
        return False
    return any(k.removeprefix("model.").startswith("cross_attn.") for k in _weight_names(path))


def load_glide(path: Path, config: dict, target):
    """A LongSpec GLIDE directory: one decoder layer, the target's config, embedding and LM head."""
    import transformers

    from fold.spec_decode.glide import GlideConfig, GlideDrafter

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
    types = sorted(set(getattr(tc, "layer_types", None) or ["full_attention"]))
    if types != ["full_attention"]:
        raise ValueError(f"{path}: a GLIDE drafter cross-attends the target's last-layer KV cache at true positions; "
                         f"targets with {types} layers (sliding-window or linear attention) are not supported")
    check_fits(cfg, tc, f"{path}: ")
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

    Formats (``fold/spec_decode/FAMILIES.md`` has the table of targets x formats):

    - z-lab DFlash (``DFlashDraftModel`` or a ``dflash_config`` block): Qwen3-style blocks, the
      target's embedding and LM head, with ``input_embedding_scale``, ``output_multiplier`` and
      ``final_logit_softcapping`` (Gemma drafters; ``dflash_config``'s, else the top level's, as
      upstream DFlash reads them); sliding-window layers from ``layer_types`` / ``sliding_window`` /
      ``use_sliding_window``, causal unless ``is_causal`` says otherwise. A field that upstream
      DFlash and vLLM read differently (``dflash_config.causal``, ``dflash_config.swa_window_size``)
      is refused naming both readings unless they agree.
    - z-lab DFlash 2 (``DFlash2DraftModel``): the same, plus two dynamic convolutions per layer and
      the candidate selector (``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
      ``selector_top_k``; codebooks as bare tensors or with ``.weight``).
    - DeepSpec DFlash/DSpark (``Qwen3DSparkModel``, ``Gemma4DSparkModel``): shipped embedding and
      head, every slot drafts, vanilla Markov head when ``markov_rank > 0``; a confidence head, if
      shipped, is not used. The Gemma-4 block is read from ``config.json`` (DeepSpec's own code
      needs transformers 5.10).
    - LongSpec GLIDE (a single decoder layer with ``self_attn`` and ``cross_attn``, the target's
      config): :class:`fold.spec_decode.glide.GlideDrafter`.

    Everything is checked here, before any generation: unreadable or invalid files and fields are a
    ``ValueError``/``TypeError`` naming the file and the field, as is a drafter that does not fit
    ``target`` (hidden size, vocabulary, tapped layers, ``fc`` width, mask id). Unknown formats,
    ``use_swa``, causal full-attention layers and non-vanilla Markov heads are refused by name.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a drafter directory (no config.json)")
    raw = read_json(path / "config.json")
    if _is_glide(path, raw):
        return load_glide(path, raw, target)
    cfg = read_config(path, target.config)
    check_fits(cfg, target.config, f"{path}: ")
    drafter = Drafter(cfg)
    state = _load_weights(path)
    state = {k: v for k, v in state.items() if not k.startswith("confidence_head.")}
    for name in CODEBOOKS:                                  # published bare; as nn.Embedding, with .weight
        if name + ".weight" in state:
            state[name] = state.pop(name + ".weight")
    fc = state.get("fc.weight")
    if fc is not None and fc.shape[1] != len(cfg.target_layer_ids) * target.config.hidden_size:
        raise ValueError(f"{path}: fc.weight takes {fc.shape[1]} features but {len(cfg.target_layer_ids)} tapped "
                         f"layers x hidden_size {target.config.hidden_size} = "
                         f"{len(cfg.target_layer_ids) * target.config.hidden_size}")
    if not cfg.has_embeddings:
        table = getattr(target.get_input_embeddings(), "weight", None)
        if table is None or tuple(table.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"{path}: a z-lab drafter reads the target's embedding table, which must be "
                             f"[vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}], got "
                             f"{None if table is None else tuple(table.shape)}")
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    wrong = [f"{k} {tuple(v.shape)} (config wants {shapes[k]})" for k, v in sorted(state.items())
             if k in shapes and tuple(v.shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{path}: weights do not match config.json: {wrong[:4]}")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    drafter.bind(target)
    dtype = next(target.parameters()).dtype
    return drafter.to(device=next(target.parameters()).device, dtype=dtype).eval()
