"""fold inside the engine as GPU users serve: vLLM's default dtype (bfloat16) and compiled mode, fold's
Triton kernels (the launches a GPU runs, here in Triton's interpreter), an FP8 drafter cache, the
rope types drafters ship with, and the drafter classes fold registers besides DFlashDraftModel."""

import json

import pytest
import torch

import fold.kernels.fold_attention as kernels
import fold.vllm
from reference.tolerance import check_close
from tests.vllm.engine import (MAX_TOKENS, PROMPTS, SMALL_W, Recorder, configured, drafting, generate, run_recorded,
                               served, truth)
from tests.vllm.pair import make_drafter

SHORT = dict(prompts=PROMPTS[:2], max_tokens=[16, 12])        # the interpreter runs each launch in numpy


def _far_read(calls):
    return any(min(c["seq_lens"]) - c["n_q"] > (c["sliding"] or c["read"].window + c["n_q"]) for c in calls)


@pytest.fixture(scope="module")
def bf16_compiled(pairs):
    """vLLM's defaults for this float32 checkpoint but the dtype (bfloat16, as every GPU serves) and
    its compiled mode (enforce_eager=False), the drafter read by fold's Triton kernels."""
    runs = dict(ar=served(lambda llm: generate(llm, SHORT["prompts"], SHORT["max_tokens"]), pairs["plain"],
                          dtype="bfloat16", eager=False))
    drafter = configured(pairs, "drafter-triton", read="fold", window=SMALL_W, alpha=2.0, backend="triton")
    with Recorder(kernels, "fold_attention_fwd", lambda *a: None) as launches:
        runs["fold"] = served(lambda llm: run_recorded(llm, SHORT["prompts"], SHORT["max_tokens"]), pairs["plain"],
                              drafter, dtype="bfloat16", eager=False)
    runs["launches"] = len(launches.calls)
    return runs


def test_bf16_compiled_engine_on_the_triton_path_is_lossless(bf16_compiled):
    out, calls, drafts, _ = bf16_compiled["fold"]
    assert out == bf16_compiled["ar"]
    assert len({t for o in out for t in o}) > 8                      # the output varies: a real comparison
    assert bf16_compiled["launches"] == len(calls) > 10             # every drafter read ran fold's kernels
    assert all(c["q"].dtype == torch.bfloat16 for c in calls)


def test_bf16_triton_reads_equal_the_reference(bf16_compiled):
    calls = drafting(bf16_compiled["fold"][1])
    assert len(calls) >= 10 and _far_read(calls)
    for i, call in enumerate(calls):
        check_close(f"call {i}", call["out"], truth(call, True), truth(call, False), torch.bfloat16)


@pytest.fixture(scope="module")
def sliding_triton(pairs):
    """A sliding-window drafter (causal, Gemma-style layers) read by fold's kernels."""
    drafter = make_drafter(pairs["root"] / "drafter-swa-causal", config_overrides=dict(dflash_config=dict(
        block_size=4, target_layer_ids=[0, 2], mask_token_id=255, use_swa=True, swa_window_size=16, causal=True)))
    block = fold.vllm.configure(drafter, pairs["root"] / "drafter-swa-triton", read="fold", window=SMALL_W, alpha=2.0,
                                backend="triton")
    with Recorder(kernels, "fold_attention_fwd", lambda *a: None) as launches:
        recorded = served(lambda llm: run_recorded(llm, SHORT["prompts"], SHORT["max_tokens"]), pairs["plain"], block,
                          blocks=128)
    return recorded, len(launches.calls)


def test_a_sliding_drafter_on_the_triton_path_follows_the_per_layer_rule(sliding_triton, target_greedy):
    (out, calls, _, _), launches = sliding_triton
    assert out == [o[:m] for o, m in zip(target_greedy[0][:2], SHORT["max_tokens"])]
    calls = drafting(calls)
    assert launches >= len(calls) >= 10 and {c["sliding"] for c in calls} == {16} and all(c["causal"] for c in calls)
    assert _far_read(calls)
    for i, call in enumerate(calls):
        check_close(f"call {i}", call["out"], truth(call, True), truth(call, False), torch.float32)


@pytest.fixture(scope="module", params=["fp8", "fp8_e5m2"])
def fp8(request, pairs):
    """The drafter's own cache in FP8 (speculative_config.kv_cache_dtype), the target's as it was."""
    drafter = configured(pairs, "drafter-fold", read="fold", window=SMALL_W, alpha=2.0)
    return request.param, served(lambda llm: run_recorded(llm, PROMPTS, MAX_TOKENS), pairs["plain"], drafter,
                                 draft_cache_dtype=request.param)


def test_an_fp8_drafter_cache_is_lossless_and_read_as_its_dequantized_values(fp8, target_greedy):
    dtype, (out, calls, _, _) = fp8
    assert out == target_greedy[0]
    calls = drafting(calls)
    assert len(calls) >= 20 and _far_read(calls)
    for i, call in enumerate(calls):                     # the recorder dequantizes the pages it reads back
        check_close(f"{dtype} call {i}", call["out"], truth(call, True), truth(call, False), torch.float32)


ROPES = {
    "yarn": dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=1024),
    "llama3": dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=512),
    "linear": dict(rope_type="linear", rope_theta=1e4, factor=2.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
    "partial": dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_drafters_with_scaled_ropes_are_served_in_bf16(pairs, rope):
    """A drafter whose config.json asks for YaRN / Llama-3 / linear / dynamic-NTK scaling or partial
    rotary starts (the table checked at bfloat16's precision) and reads as the reference with the Rope
    fold recovered."""
    drafter = make_drafter(pairs["root"] / f"drafter-{rope}", config_overrides=dict(rope_parameters=ROPES[rope]))
    block = fold.vllm.configure(drafter, pairs["root"] / f"drafter-{rope}-fold", read="fold", window=SMALL_W, alpha=2.0)
    _, calls, _, _ = served(lambda llm: run_recorded(llm, SHORT["prompts"], SHORT["max_tokens"]), pairs["plain"], block,
                            dtype="bfloat16")
    calls = drafting(calls)
    assert len(calls) >= 10 and _far_read(calls)
    assert calls[0]["rope"].attention_factor != 1.0 or rope != "yarn"
    assert (calls[0]["rope"].rotary_dim == 32) == (rope == "partial")          # head_dim 64, half rotated
    for i, call in enumerate(calls):
        check_close(f"{rope} call {i}", call["out"], truth(call, True), truth(call, False), torch.bfloat16)


def test_a_drafter_under_another_registered_name_is_served(pairs, target_greedy):
    """MuseGlimmerAssistantModel (vLLM maps it to DFlashQwen3ForCausalLM, prefixed DFlash under
    method='dflash'): fold serves its layers as DFlashDraftModel's."""
    drafter = configured(pairs, "drafter-glimmer", read="fold", window=SMALL_W, alpha=2.0)
    config = json.loads((drafter / "config.json").read_text())
    config["architectures"] = ["MuseGlimmerAssistantModel"]
    (drafter / "config.json").unlink()
    (drafter / "config.json").write_text(json.dumps(config))
    out, calls, _, _ = served(lambda llm: run_recorded(llm, SHORT["prompts"], SHORT["max_tokens"]), pairs["plain"],
                              drafter)
    assert out == [o[:m] for o, m in zip(target_greedy[0][:2], SHORT["max_tokens"])]
    assert len(drafting(calls)) >= 10
