"""Tiny random targets and drafters written to disk in the real formats, and the AR baseline."""

import json

import torch
from safetensors.torch import save_file

import transformers
from fold.spec_decode import TargetSession

VOCAB = 97
TARGET_LAYERS = 4


TARGET_WINDOW = 8      # the tiny Gemma-4 target's sliding window


def target_config(kind: str, vocab: int = VOCAB):
    """Configs of the tiny targets: "llama", "qwen3", "qwen3_5" (Gated DeltaNet + gated full attention,
    partial RoPE), "gemma4" (sliding + full layers, attention_k_eq_v, proportional RoPE, softcap) and
    "gemma4_shared" (the same with KV sharing: the last two layers reuse the first two's K/V)."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  initializer_range=0.3, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if kind == "qwen3_5":
        return transformers.AutoConfig.for_model(
            "qwen3_5_text", **common, layer_types=["linear_attention", "full_attention"] * (TARGET_LAYERS // 2),
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4)
    if kind in ("gemma4", "gemma4_shared"):   # small global_head_dim / per-layer inputs, or the defaults make it huge
        return transformers.AutoConfig.for_model(
            "gemma4_text", **common, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=vocab, sliding_window=TARGET_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2), final_logit_softcapping=30.0,
            num_kv_shared_layers=2 if kind == "gemma4_shared" else 0)   # _shared: the last two reuse earlier K/V
    raise ValueError(f"unknown target kind {kind!r}")


def make_target(kind: str, path, seed: int = 0, vocab: int = VOCAB):
    """A tiny causal LM of ``kind`` (see :func:`target_config`), saved and loaded back (float32)."""
    torch.manual_seed(seed)
    config = target_config(kind, vocab)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def drafter_backbone(hidden, layers, heads_q, heads_kv, head_dim, inter, n_taps, gen, scale=0.2):
    """The state dict of a z-lab/Qwen3-style drafter block (fc, norms, attention, SwiGLU), weights
    normal(0, ``scale``) from ``gen``."""
    w = lambda *s: torch.randn(*s, generator=gen) * scale  # noqa: E731
    state = {"fc.weight": w(hidden, n_taps * hidden), "hidden_norm.weight": torch.ones(hidden),
             "norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(heads_q * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(heads_kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(heads_kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads_q * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    return state


DRAFTER_WINDOW = 5     # the sliding window of the tiny z-lab drafters' sliding layers
GEMMA_HEAD_DIM = 32    # Gemma4DSparkModel's head_dim (the target's global_head_dim)


def _gemma4_backbone(hidden, layers, heads_q, heads_kv, head_dim, inter, n_taps, gen, k_eq_v):
    w = lambda *s: torch.randn(*s, generator=gen) * 0.2  # noqa: E731
    state = {"fc.weight": w(hidden, n_taps * hidden), "hidden_norm.weight": 1 + w(hidden), "norm.weight": 1 + w(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(heads_q * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(heads_kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads_q * head_dim),
            p + "self_attn.q_norm.weight": 1 + w(head_dim), p + "self_attn.k_norm.weight": 1 + w(head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight": 1 + w(hidden),
            p + "pre_feedforward_layernorm.weight": 1 + w(hidden),
            p + "post_feedforward_layernorm.weight": 1 + w(hidden),
            p + "layer_scalar": torch.tensor([0.5 + 0.1 * i]),
        })
        if not k_eq_v:
            state[p + "self_attn.v_proj.weight"] = w(heads_kv * head_dim, hidden)
    return state


def make_drafter(path, target, fmt: str, *, block_size=4, layers=2, taps=(0, 2), markov_rank=8, seed=0,
                 config_overrides=None, k_eq_v=True):
    """Write a drafter directory. ``fmt``:

    - "zlab", "zlab-legacy": z-lab DFlash (block size in ``dflash_config`` / at top level);
    - "zlab-swa": z-lab with a sliding-window layer (window ``DRAFTER_WINDOW``) before a full one,
      as the Qwen3.5 drafters; "zlab-gemma": the same plus ``input_embedding_scale``,
      ``output_multiplier`` and ``final_logit_softcapping`` (z-lab's Gemma drafters);
    - "deepspec-dflash", "dspark": DeepSpec ``Qwen3DSparkModel``;
    - "gemma4-dflash", "gemma4-dspark": DeepSpec ``Gemma4DSparkModel`` (``attention_k_eq_v`` per ``k_eq_v``).
    """
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tc = target.config
    geometry = dict(hidden_size=tc.hidden_size, intermediate_size=96, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                    attention_bias=False, hidden_act="silu", vocab_size=tc.vocab_size, max_position_embeddings=4096,
                    num_target_layers=tc.num_hidden_layers)
    state = drafter_backbone(tc.hidden_size, layers, 4, 2, 16, 96, len(taps), gen)
    mask_id = tc.vocab_size - 1
    if fmt in ("zlab", "zlab-swa", "zlab-gemma"):   # transformers-5 style revision: block size inside dflash_config
        config = dict(model_type="qwen3", architectures=["DFlashDraftModel"], **geometry,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      dflash_config=dict(block_size=block_size, target_layer_ids=list(taps), mask_token_id=mask_id))
        if fmt != "zlab":
            config.update(layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
                          sliding_window=DRAFTER_WINDOW, use_sliding_window=True)
        if fmt == "zlab-gemma":
            config["dflash_config"].update(input_embedding_scale=8.0, output_multiplier=0.5,
                                           final_logit_softcapping=4.0)
    elif fmt in ("gemma4-dflash", "gemma4-dspark"):
        rank = markov_rank if fmt == "gemma4-dspark" else 0
        config = dict(model_type="gemma4_text", architectures=["Gemma4DSparkModel"], hidden_size=tc.hidden_size,
                      intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, global_head_dim=GEMMA_HEAD_DIM, num_global_key_value_heads=1 if k_eq_v else 2,
                      attention_k_eq_v=k_eq_v, rms_norm_eps=1e-6, attention_bias=False,
                      hidden_activation="gelu_pytorch_tanh", vocab_size=tc.vocab_size, final_logit_softcapping=30.0,
                      layer_types=["full_attention"] * layers, sliding_window=512, hidden_size_per_layer_input=0,
                      rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                          "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                      num_target_layers=tc.num_hidden_layers, block_size=block_size, target_layer_ids=list(taps),
                      mask_token_id=mask_id, num_anchors=512, markov_rank=rank, markov_head_type="vanilla",
                      enable_confidence_head=True, confidence_head_with_markov=False, tie_word_embeddings=False)
        state = _gemma4_backbone(tc.hidden_size, layers, 4, 1 if k_eq_v else 2, GEMMA_HEAD_DIM, 96, len(taps), gen,
                                 k_eq_v)
        state["embed_tokens.weight"] = torch.randn(tc.vocab_size, tc.hidden_size, generator=gen) * 0.1
        state["lm_head.weight"] = torch.randn(tc.vocab_size, tc.hidden_size, generator=gen) * 0.5
        state["confidence_head.proj.weight"] = torch.randn(1, tc.hidden_size, generator=gen)
        state["confidence_head.proj.bias"] = torch.zeros(1)
        if rank:
            state["markov_head.markov_w1.weight"] = torch.randn(tc.vocab_size, rank, generator=gen)
            state["markov_head.markov_w2.weight"] = torch.randn(tc.vocab_size, rank, generator=gen) * 0.5
    elif fmt == "zlab-legacy":  # older revision: top-level block_size and rope_theta
        config = dict(model_type="qwen3", architectures=["DFlashDraftModel"], **geometry, rope_theta=10000.0,
                      block_size=block_size, dflash_config=dict(target_layer_ids=list(taps), mask_token_id=mask_id))
    else:
        rank = markov_rank if fmt == "dspark" else 0
        config = dict(model_type="qwen3", architectures=["Qwen3DSparkModel"], **geometry,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, block_size=block_size,
                      target_layer_ids=list(taps), mask_token_id=mask_id, markov_rank=rank,
                      markov_head_type="vanilla", enable_confidence_head=True, tie_word_embeddings=False)
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
        state["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
        state["confidence_head.proj.weight"] = torch.randn(1, tc.hidden_size + rank, generator=gen)
        state["confidence_head.proj.bias"] = torch.zeros(1)
        if rank:
            state["markov_head.markov_w1.weight"] = torch.randn(tc.vocab_size, rank, generator=gen)
            state["markov_head.markov_w2.weight"] = torch.randn(tc.vocab_size, rank, generator=gen) * 0.5
    config.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


@torch.no_grad()
def greedy_ar(target, ids, max_new_tokens, eos=()):
    """The target's own greedy generation, one token per forward with its cache."""
    session = TargetSession(target)
    logits, _ = session.prefill(ids)
    new = [int(logits.argmax())]
    while len(new) < max_new_tokens and new[-1] not in eos:
        logits, _ = session.decode(new[-1])
        new.append(int(logits.argmax()))
    return torch.cat([ids, torch.tensor(new)])


def make_glide(path, target, seed=0, window=None):
    """A LongSpec GLIDE directory: the target's config + one layer of self_attn/cross_attn/mlp weights."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tc = target.config
    h, heads_q, heads_kv = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads
    d = h // heads_q
    w = lambda *s: torch.randn(*s, generator=gen) * 0.2  # noqa: E731
    state = {"mlp.gate_proj.weight": w(tc.intermediate_size, h), "mlp.up_proj.weight": w(tc.intermediate_size, h),
             "mlp.down_proj.weight": w(h, tc.intermediate_size), "input_layernorm.weight": torch.ones(h),
             "post_self_attention_layernorm.weight": torch.ones(h),
             "post_cross_attention_layernorm.weight": torch.ones(h)}
    for part in ("self_attn", "cross_attn"):
        state.update({f"{part}.q_proj.weight": w(heads_q * d, h), f"{part}.q_proj.bias": w(heads_q * d),
                      f"{part}.k_proj.weight": w(heads_kv * d, h), f"{part}.k_proj.bias": w(heads_kv * d),
                      f"{part}.v_proj.weight": w(heads_kv * d, h), f"{part}.v_proj.bias": w(heads_kv * d),
                      f"{part}.o_proj.weight": w(h, heads_q * d)})
    config = tc.to_dict()
    config["architectures"] = ["LlamaGlideDecoderLayer"]
    if window is not None:
        config["glide_window"] = window
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


SAMPLING_VOCAB = 8                  # the vocabulary of the sampling tests' tiny pairs
CHI2_CRIT_DF7_P001 = 24.322         # chi-square critical value, 7 degrees of freedom, p = 0.001


def assert_follows(counts, expected, what: str = "") -> None:
    """``counts`` [8] drawn tokens against ``expected`` [8] counts: a chi-square test at p = 0.001."""
    assert len(counts) == len(expected) == SAMPLING_VOCAB, "the critical value is the one for 8 outcomes"
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_DF7_P001, f"{what}chi2 {chi2:.1f}, counts {counts.tolist()}, " \
                                      f"expected {[round(x, 1) for x in expected.tolist()]}"


def padded_batch(prompts, side="left"):
    """``(input_ids, attention_mask)`` of 1-D prompts padded with zeros on ``side``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[b, cols], mask[b, cols] = p, 1
    return ids, mask


def rewrite_config(path, **changes):
    """Change a checkpoint directory's config.json in place: ``key=value`` sets, ``key=None`` removes."""
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))



# small options for each built policy, shared by the loop and family tests
OPTIONS = {"dflash": {}, "window": {"window": 8}, "fold": {"window": 8}, "streaming": {"sinks": 2, "recent": 10},
           "yarn": {"reference_len": 32}, "rerope": {"window": 8, "training_length": 16},
           "infllm": {"window": 8, "infllm_block": 4, "infllm_init": 4, "infllm_topk": 2, "infllm_repr": 2},
           "cmr": {"cmr_chunk": 4, "cmr_top": 3, "cmr_every": 2}}


DFLASH2_SIZES = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def make_dflash2(path, target, *, base="zlab", block_size=4, layers=2, seed=1, sizes=None, config_overrides=None,
                 codebook_suffix="", dtype=torch.bfloat16):
    """A z-lab DFlash 2 directory (``DFlash2DraftModel``) in the published layout: :func:`make_drafter`'s
    ``base`` ("zlab" or "zlab-swa") plus, per layer, ``attention_conv`` and ``mlp_conv`` (``base_kernel
    [2, K, H]``, ``kernel_projection.weight [2 K H / group, H]``) and ``candidate_selector`` (its two codebooks
    bare tensors, or with ``codebook_suffix=".weight"``, and ``hidden_projection.weight``); ``sizes``
    (default :data:`DFLASH2_SIZES`) in ``dflash_config`` only. Weights stored in ``dtype``."""
    sizes = {**DFLASH2_SIZES, **(sizes or {})}
    path = make_drafter(path, target, base, block_size=block_size, layers=layers, seed=seed)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(sizes)
    config.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed + 1000)
    w = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    hidden, vocab, taps = target.config.hidden_size, target.config.vocab_size, sizes["conv_kernel_size"]
    groups = hidden // sizes["conv_group_size"]
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            base_kernel = 0.3 * w(2, taps, hidden)
            base_kernel[:, 0] += 1.0                                       # near the identity at tap 0
            state[f"layers.{i}.{conv}.base_kernel"] = base_kernel
            state[f"layers.{i}.{conv}.kernel_projection.weight"] = 0.1 * w(2 * taps * groups, hidden)
    rank = sizes["selector_rank"]
    state["candidate_selector.predecessor_codebook" + codebook_suffix] = w(vocab, rank)
    state["candidate_selector.successor_codebook" + codebook_suffix] = w(vocab, rank)
    state["candidate_selector.hidden_projection.weight"] = 0.1 * w(rank, hidden)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path
