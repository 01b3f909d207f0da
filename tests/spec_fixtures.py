"""Tiny random targets and drafters written to disk in the real formats, and the AR baseline."""

import json

import torch
from safetensors.torch import save_file

import transformers
from fold.spec import _hf

VOCAB = 97
TARGET_LAYERS = 4


def make_target(kind: str, path, seed: int = 0, vocab: int = VOCAB):
    """A tiny Llama or Qwen3 causal LM, saved with save_pretrained and loaded back (float32)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  initializer_range=0.3, tie_word_embeddings=False)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        config = transformers.Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _backbone(hidden, layers, heads_q, heads_kv, head_dim, inter, n_taps, gen):
    w = lambda *s: torch.randn(*s, generator=gen) * 0.2  # noqa: E731
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


def make_drafter(path, target, fmt: str, *, block_size=4, layers=2, taps=(0, 2), markov_rank=8, seed=0,
                 config_overrides=None):
    """Write a drafter directory: fmt in {"zlab", "zlab-legacy", "deepspec-dflash", "dspark"}."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tc = target.config
    geometry = dict(hidden_size=tc.hidden_size, intermediate_size=96, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                    attention_bias=False, hidden_act="silu", vocab_size=tc.vocab_size, max_position_embeddings=4096,
                    num_target_layers=tc.num_hidden_layers)
    state = _backbone(tc.hidden_size, layers, 4, 2, 16, 96, len(taps), gen)
    mask_id = tc.vocab_size - 1
    if fmt == "zlab":          # transformers-5 style revision: block size inside dflash_config
        config = dict(model_type="qwen3", architectures=["DFlashDraftModel"], **geometry,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      dflash_config=dict(block_size=block_size, target_layer_ids=list(taps), mask_token_id=mask_id))
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
    logits, _, cache = _hf.forward(target, ids[None])
    new = [int(logits[0, -1].argmax())]
    while len(new) < max_new_tokens and new[-1] not in eos:
        logits, _, cache = _hf.forward(target, torch.tensor([[new[-1]]]), cache)
        new.append(int(logits[0, -1].argmax()))
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


def padded_batch(prompts, side="left"):
    """``(input_ids, attention_mask)`` of 1-D prompts padded with zeros on ``side``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[b, cols], mask[b, cols] = p, 1
    return ids, mask
