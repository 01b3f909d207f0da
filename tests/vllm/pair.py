"""A tiny random target (Qwen3) and a z-lab DFlash drafter for it, written to disk in the real formats
(head_dim 64: vLLM's CPU attention takes 32, 64, 80, ...)."""

import json

import torch
from safetensors.torch import save_file

from tests.spec_decode_fixtures import drafter_backbone

VOCAB = 256
HIDDEN = 128
HEAD_DIM = 64
TARGET_LAYERS = 4
TAPS = (0, 2)
MASK_ID = VOCAB - 1


FAVOURITE = 7          # the token a shared embedding direction pushes both models towards


def make_target(path, seed=0, pull=0.0, shift=1.0):
    """A tiny random Qwen3. ``shift`` adds one direction (``shift`` times an embedding's norm) to every
    embedding and ``pull`` times it to :data:`FAVOURITE`'s LM-head row, so target and drafter (which
    shares both) often agree on it: drafts get accepted now and then, as a trained drafter's would.
    Without the shift (``shift=0``) its greedy output varies from token to token."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=4096,
        initializer_range=0.1, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        u = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
        u /= u.norm()                                                          # the shared direction
        model.model.embed_tokens.weight += shift * model.model.embed_tokens.weight.norm(dim=1).mean() * u
        model.lm_head.weight[FAVOURITE] += pull * u
    model.save_pretrained(path)
    return path


def make_drafter(path, *, layers=2, heads=(4, 2), seed=0, scale=0.3, sinks=False, fold=None, config_overrides=None,
                 hidden=HIDDEN, vocab=VOCAB, taps=TAPS, mask_id=MASK_ID, target_layers=TARGET_LAYERS):
    """A z-lab DFlash directory (``DFlashDraftModel``, no embedding / LM head: the target's are used);
    ``sinks``: per-head attention sink logits (``dflash_config.attention_sink_bias``);
    ``fold``: the ``fold`` block of its config.json. The geometry defaults to this module's tiny target;
    ``hidden``, ``vocab``, ``taps``, ``mask_id``, ``target_layers`` fit it to another (a random drafter
    for a real target, to measure costs)."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    heads_q, heads_kv = heads
    state = drafter_backbone(hidden, layers, heads_q, heads_kv, HEAD_DIM, 192, len(taps), gen, scale=scale)
    if sinks:
        for i in range(layers):
            state[f"layers.{i}.self_attn.attention_sink_bias"] = torch.randn(heads_q, generator=gen) + 2.0
    config = dict(model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=hidden, intermediate_size=192,
                  num_hidden_layers=layers, num_attention_heads=heads_q, num_key_value_heads=heads_kv,
                  head_dim=HEAD_DIM, rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu", vocab_size=vocab,
                  max_position_embeddings=4096, num_target_layers=target_layers,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                  dflash_config=dict(block_size=4, target_layer_ids=list(taps), mask_token_id=mask_id,
                                     attention_sink_bias=sinks))
    if fold is not None:
        config["fold"] = fold
    config.update(config_overrides or {})
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path
