"""Tiny random drafters, beside the pair's z-lab DFlash one, for the other V2 speculators of vLLM 0.34.

Each is written to disk in the format vLLM 0.34's model class loads (and, for DSpark, the format
``fold.spec_decode.load_drafter`` reads too), fitted to the pair's target (``tests/vllm/pair.py``:
hidden 128, vocabulary 256, taps (0, 2)): every weight vLLM's class declares is in the file, since
vLLM refuses a checkpoint that leaves one out.

- :func:`dspark`: DeepSpec ``Qwen3DSparkModel`` (``DSparkSpeculator``): the z-lab backbone, K query rows
  that each draft (anchor-as-first), a vanilla Markov head;
- :func:`gemma4_dspark`: DeepSpec ``Gemma4DSparkModel`` (``DSparkSpeculator``): Gemma-4 layers (sandwich
  norms, ``layer_scalar``, ``attention_k_eq_v``, proportional partial RoPE, scale 1), soft-capped final
  logits, a Markov head;
- :func:`xpress`: ``Qwen3XPressModel`` (``XPressSpeculator``): the z-lab DFlash drafter plus XPress's
  Jacobi refiner head;
- :func:`dflash2`: ``DFlash2DraftModel`` (``DFlash2Speculator``): DFlash layers wrapped in grouped
  convolutions, a candidate selector; with ``no_rope_layers`` vLLM makes it ``DFlash2RicursiveDraftModel``;
- :func:`lilicorr`: ``LiLiCorrDraftModel`` (``LiLiCorrSpeculator``, a DFlash 2 speculator): the z-lab
  backbone plus LiLiCorr's candidate-lattice head.

The embedding and LM head a DSpark drafter ships are the target's own: vLLM 0.34's DSpark loader
puts the target's in place of a drafter's that did not report its own (``Gemma4DSparkForCausalLM``'s
``load_weights`` reports neither), and ``fold.spec_decode`` reads the shipped ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.spec_decode_fixtures import _gemma4_backbone, drafter_backbone
from tests.vllm.pair import HEAD_DIM, HIDDEN, MASK_ID, TAPS, TARGET_LAYERS, VOCAB, make_drafter

MARKOV_RANK = 8
GEMMA_HEAD_DIM = 64          # Gemma4DSparkModel's head_dim: the target's global_head_dim
GEMMA_PARTIAL = 0.25         # its proportional RoPE rotates 8 of 32 frequency pairs
CONV_TAPS, CONV_GROUP = 2, 32
CANDIDATES = 4               # DFlash 2's selector_top_k, LiLiCorr's lilicorr_candidate_topk
LILICORR_BLOCK = 5           # LiLiCorr's trained block: num_speculative_tokens must stay below it


def _randn(gen, scale=0.3):
    return lambda *shape: torch.randn(*shape, generator=gen) * scale


def _target_embeddings(target: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(Path(target) / "model.safetensors"))
    return {"embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
            "lm_head.weight": weights["lm_head.weight"].clone()}


def _markov(gen) -> dict[str, torch.Tensor]:
    return {"markov_head.markov_w1.weight": torch.randn(VOCAB, MARKOV_RANK, generator=gen),
            "markov_head.markov_w2.weight": torch.randn(VOCAB, MARKOV_RANK, generator=gen) * 0.5}


def _write(path: Path, config: dict, state: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def _with_weights(path: Path, extra: dict) -> Path:
    """``path``'s checkpoint with ``extra`` tensors added."""
    state = load_file(str(path / "model.safetensors"))
    state.update(extra)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def dspark(path: Path, target: Path, *, block_size: int, seed=1) -> Path:
    """DeepSpec ``Qwen3DSparkModel``: ``block_size`` rows per round, each drafting (``block_size`` = K),
    ``target_layer_ids`` / ``mask_token_id`` / ``block_size`` at the top level."""
    gen = torch.Generator().manual_seed(seed)
    state = drafter_backbone(HIDDEN, 2, 4, 2, HEAD_DIM, 192, len(TAPS), gen, scale=0.3)
    state.update(_target_embeddings(target), **_markov(gen))
    config = dict(model_type="qwen3", architectures=["Qwen3DSparkModel"], hidden_size=HIDDEN, intermediate_size=192,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                  rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu", vocab_size=VOCAB,
                  max_position_embeddings=4096, num_target_layers=TARGET_LAYERS,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}, block_size=block_size,
                  target_layer_ids=list(TAPS), mask_token_id=MASK_ID, markov_rank=MARKOV_RANK,
                  markov_head_type="vanilla", enable_confidence_head=False, tie_word_embeddings=False)
    return _write(Path(path), config, state)


def gemma4_dspark(path: Path, target: Path, *, block_size: int, seed=2, config_overrides=None) -> Path:
    """DeepSpec ``Gemma4DSparkModel``: two full-attention Gemma-4 layers (one KV head of 64, values from
    ``k_proj``), final logits soft-capped at 30; ``config_overrides`` (e.g. ``attn_logit_softcapping``)."""
    gen = torch.Generator().manual_seed(seed)
    state = _gemma4_backbone(HIDDEN, 2, 4, 1, GEMMA_HEAD_DIM, 96, len(TAPS), gen, True)
    state.update(_target_embeddings(target), **_markov(gen))
    config = dict(model_type="gemma4_text", architectures=["Gemma4DSparkModel"], hidden_size=HIDDEN,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  global_head_dim=GEMMA_HEAD_DIM, num_global_key_value_heads=1, attention_k_eq_v=True,
                  rms_norm_eps=1e-6, attention_bias=False, hidden_activation="gelu_pytorch_tanh", vocab_size=VOCAB,
                  final_logit_softcapping=30.0, layer_types=["full_attention"] * 2, sliding_window=512,
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB, max_position_embeddings=4096,
                  rope_parameters={"full_attention": {"rope_type": "proportional",
                                                      "partial_rotary_factor": GEMMA_PARTIAL, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                  num_target_layers=TARGET_LAYERS, block_size=block_size, target_layer_ids=list(TAPS),
                  mask_token_id=MASK_ID, markov_rank=MARKOV_RANK, markov_head_type="vanilla",
                  enable_confidence_head=False, tie_word_embeddings=False)
    config.update(config_overrides or {})
    return _write(Path(path), config, state)


def xpress(path: Path, *, block_size: int, rank=16, mlp_hidden=64, seed=3) -> Path:
    """``Qwen3XPressModel``: the pair's z-lab drafter plus a refiner head of ``rank`` over a block of
    ``block_size`` = K + 1 (fill-in layout), exact full-vocabulary scoring (``xpress_topc`` 0), two
    Jacobi passes, the head not compiled."""
    w = _randn(torch.Generator().manual_seed(seed))
    head = {"w1.weight": w(VOCAB, rank), "down_h.weight": w(rank, HIDDEN), "down_g.weight": w(rank, HIDDEN),
            "in_proj.weight": w(rank, 3 * rank), "mix.L": w(rank, block_size, block_size),
            "mlp.gate_proj.weight": w(mlp_hidden, rank), "mlp.up_proj.weight": w(mlp_hidden, rank),
            "mlp.down_proj.weight": w(rank, mlp_hidden), "w2.weight": w(VOCAB, rank)}
    path = make_drafter(Path(path), config_overrides=dict(
        architectures=["Qwen3XPressModel"], xpress_block_size=block_size, xpress_rank=rank,
        xpress_mlp_hidden=mlp_hidden, xpress_topc=0, xpress_compile_head=False, xpress_num_passes=2))
    return _with_weights(path, {f"xpress_head.{k}": v for k, v in head.items()})


def dflash2(path: Path, *, no_rope_layers=None, rank=8, seed=4) -> Path:
    """``DFlash2DraftModel``: grouped convolutions of :data:`CONV_TAPS` taps around each layer's attention
    and MLP, a candidate selector of :data:`CANDIDATES`; ``no_rope_layers`` (a list of layer indices)
    makes vLLM serve it as ``DFlash2RicursiveDraftModel`` (those layers NoPE)."""
    w = _randn(torch.Generator().manual_seed(seed))
    extra = {"candidate_selector.predecessor_codebook": w(VOCAB, rank),
             "candidate_selector.successor_codebook": w(VOCAB, rank),
             "candidate_selector.hidden_projection.weight": w(rank, HIDDEN)}
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            extra[f"layers.{i}.{conv}.base_kernel"] = w(2, CONV_TAPS, HIDDEN)
            extra[f"layers.{i}.{conv}.kernel_projection.weight"] = w(2 * CONV_TAPS * HIDDEN // CONV_GROUP, HIDDEN) * 0.1
    dflash = dict(block_size=4, target_layer_ids=list(TAPS), mask_token_id=MASK_ID, conv_kernel_size=CONV_TAPS,
                  conv_group_size=CONV_GROUP, selector_rank=rank, selector_top_k=CANDIDATES)
    overrides = dict(architectures=["DFlash2DraftModel"], dflash_config=dflash)
    if no_rope_layers is not None:
        overrides["no_rope_layers"] = list(no_rope_layers)
    return _with_weights(make_drafter(Path(path), config_overrides=overrides), extra)


LILICORR = dict(lilicorr_hidden_size=0, lilicorr_candidate_topk=CANDIDATES, lilicorr_num_heads=2,
                lilicorr_mlp_ratio=1.0, lilicorr_factor_dim=8, lilicorr_vector_eps=1e-6, lilicorr_logit_scale=4.0,
                lilicorr_num_layers=1)


def lilicorr(path: Path, seed=5) -> Path:
    """``LiLiCorrDraftModel``: the pair's z-lab drafter (no convolutions) plus a one-layer LiLiCorr head
    (trained block :data:`LILICORR_BLOCK`), its weights random at the shapes vLLM's ``LiLiCorrHead``
    declares (built here, in a model-parallel world, to read them off)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.lilicorr import LiLiCorrHead

    dflash = dict(block_size=LILICORR_BLOCK, target_layer_ids=list(TAPS), mask_token_id=MASK_ID, **LILICORR)
    with set_current_vllm_config(VllmConfig()):
        head = LiLiCorrHead(model_hidden_size=HIDDEN, block_size=LILICORR_BLOCK, rms_norm_eps=1e-6, config=dflash,
                            prefix="lilicorr")
    w = _randn(torch.Generator().manual_seed(seed))
    extra = {f"lilicorr.{name}": w(*p.shape) for name, p in head.named_parameters()}
    path = make_drafter(Path(path), config_overrides=dict(architectures=["LiLiCorrDraftModel"], dflash_config=dflash))
    return _with_weights(path, extra)
