"""The paper's other target families, Qwen3.5 (Gated DeltaNet + gated full attention) and Gemma-4
(sliding + full layers), with drafters in every format: rollback of every cache layer type,
lossless generation for every policy, tree verification, the Gemma-4 DSpark block against a dense
re-statement, and load-time errors that name the field."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from fold import spec_decode
from fold.spec_decode.policies import BUILT, make_read
from reference.tolerance import check_close
from tests.spec_decode_fixtures import (DRAFTER_WINDOW, OPTIONS, TARGET_WINDOW, greedy_ar, make_drafter, make_target,
                                 padded_batch, rewrite_config)

FAMILIES = ["qwen3_5", "gemma4", "gemma4_shared"]
FORMATS = ["zlab-swa", "zlab-gemma", "dspark", "gemma4-dflash", "gemma4-dspark"]
SMALL_VOCAB = 12          # random drafts are then accepted now and then, so rollbacks of every length happen
NEW = 12
PROMPT_LENGTHS = (24, 13, 19)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    target = make_target(request.param, tmp_path_factory.mktemp(request.param), vocab=SMALL_VOCAB)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SMALL_VOCAB - 1, (n,), generator=g) for n in PROMPT_LENGTHS]
    return request.param, target, prompts, [greedy_ar(target, p, NEW) for p in prompts]


@pytest.fixture(scope="module")
def drafters(family, tmp_path_factory):
    kind, target, _, _ = family
    return {fmt: spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp(f"{kind}-{fmt}"), target, fmt), target)
            for fmt in FORMATS}


def _double(target):
    return copy.deepcopy(target).double()


def _run(target, ids, **kwargs):
    # output_hidden_states: transformers 5.24's Gemma-4 KV-sharing shortcut indexes per-layer inputs
    # that a model without them (hidden_size_per_layer_input=0) does not have; with it the shortcut is off
    return target(ids, output_hidden_states=True, **kwargs)


# -- target side: rollback ------------------------------------------------------------------------

@pytest.mark.parametrize("kept", [0, 2, 5])
def test_rollback_continues_exactly_for_every_layer_type(family, kept):
    """Verify 5 tokens, keep ``kept``, continue: the logits equal a fresh run of the committed tokens,
    within twice the error of plain incremental decoding of the same tokens (float64 weights;
    transformers' Gated DeltaNet computes its gates and state in float32, attention stays float64).
    Sliding layers shrink back to W - 1 entries, conv states to the kernel."""
    kind, target, prompts, _ = family
    target = _double(target)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, SMALL_VOCAB - 1, (2 * TARGET_WINDOW + 3,), generator=g)
    drafts = torch.randint(0, SMALL_VOCAB - 1, (5,), generator=g)
    more = torch.randint(0, SMALL_VOCAB - 1, (3,), generator=g)
    with torch.no_grad():
        session = spec_decode.TargetSession(target)
        session.prefill(prompt)
        session.verify(drafts)
        session.commit(kept)
        first, _ = session.verify(more[:2])
        session.commit(2)                                             # everything accepted: nothing removed
        second, _ = session.verify(more[2:])
        cache = session.cache
        ours = torch.stack(list(first) + list(second))                # every row of the verifications
        fresh = _run(target, torch.cat([prompt, drafts[:kept], more])[None]).logits[0, -3:]
        out = _run(target, torch.cat([prompt, drafts[:kept]])[None], use_cache=True)     # transformers alone
        plain_cache = out["cache"] if "cache" in out else out["past_key_values"]
        plain = torch.cat([_run(target, more[None, :2], cache=plain_cache, use_cache=True).logits[0],
                           _run(target, more[None, 2:], cache=plain_cache, use_cache=True).logits[0]])
    # within the bound, a rejected token left no trace (its contribution would be of the logits' size)
    check_close(f"{kind} rollback keeping {kept}", ours, fresh, plain,
                torch.float32 if kind == "qwen3_5" else torch.float64)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            assert layer.keys.shape[2] <= TARGET_WINDOW - 1 + 1        # W - 1 kept + the last forward's row
        if hasattr(layer, "conv_states"):                              # copied, not recorded: never grows
            assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0]


def test_plain_decoding_records_nothing(family):
    """spec_decode.autoregressive's decoding steps keep sliding layers at their window and conv states at the
    kernel, and copy no state; a verification after them records again in its sliding layers (linear
    layers are copied, not recorded)."""
    _, target, prompts, _ = family
    with torch.no_grad():
        session = spec_decode.TargetSession(target)
        session.prefill(prompts[0])
        cache = session.cache
        for token in range(2 * TARGET_WINDOW):
            session.decode(token % (SMALL_VOCAB - 1))
            for layer in cache.layers:
                if getattr(layer, "is_sliding", False):
                    assert layer.keys.shape[2] <= TARGET_WINDOW - 1
                if hasattr(layer, "conv_states"):
                    assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0]
        session.verify(torch.tensor([1, 2, 3]))
        assert all(layer.record_past for layer in cache.layers if getattr(layer, "is_sliding", False))
        assert not any(layer.record_past for layer in cache.layers if hasattr(layer, "conv_states"))


@pytest.mark.parametrize("policy", BUILT)
@pytest.mark.parametrize("fmt", FORMATS)
def test_lossless_batch_three(family, drafters, fmt, policy):
    kind, target, prompts, want = family
    ids, mask = padded_batch(prompts, "left")
    result = spec_decode.generate(target, drafters[fmt], ids, attention_mask=mask, max_new_tokens=NEW, policy=policy,
                           **OPTIONS[policy])
    for b, w in enumerate(want):
        assert torch.equal(result.sequences[b, :len(w)], w), f"{kind} {fmt} {policy}: row {b} differs from AR"


def test_rounds_accept_some_drafts_and_reject_others(family, drafters):
    """The matrix above exercises partial acceptance (a rollback of fewer than all drafts)."""
    _, target, prompts, _ = family
    ids, mask = padded_batch(prompts, "left")
    accepted = []
    for fmt in ("zlab-swa", "gemma4-dspark"):
        result = spec_decode.generate(target, drafters[fmt], ids, attention_mask=mask, max_new_tokens=NEW, policy="fold",
                               window=8)
        accepted += [r for s in result.stats["per_sequence"] for r in s["accepted_per_round"]]
    assert 1 in accepted and any(r > 1 for r in accepted)


# -- target side: trees ---------------------------------------------------------------------------

@pytest.mark.parametrize("tree", [(1, 1, 1), (3, 2, 2)])
def test_tree_verification_honours_the_sliding_window(family, drafters, tree):
    kind, target, prompts, want = family
    ids, mask = padded_batch(prompts, "left")
    if kind == "qwen3_5":
        with pytest.raises(ValueError, match="linear-attention .* recurrent state"):
            spec_decode.generate(target, drafters["dspark"], ids, attention_mask=mask, max_new_tokens=4, tree=tree)
        return
    result = spec_decode.generate(target, drafters["gemma4-dspark"], ids, attention_mask=mask, max_new_tokens=NEW,
                           policy="fold", window=8, tree=tree)
    for b, w in enumerate(want):
        assert torch.equal(result.sequences[b, :len(w)], w)


def test_tree_nodes_see_their_window_and_ancestors(tmp_path):
    """Each node's logits equal the target run on prompt + its path (float64), with the prompt past the
    window and paths deep enough that the oldest window entries are seen by shallow nodes only."""
    from fold.spec_decode.tree import tree_mask, tree_verification

    target = _double(make_target("gemma4", tmp_path / "g", vocab=SMALL_VOCAB))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, SMALL_VOCAB - 1, (3 * TARGET_WINDOW,), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6]
    depths = [0, 1, 1, 2, 2, 2, 3, 3, 4]
    tokens = torch.randint(0, SMALL_VOCAB - 1, (len(parents),), generator=g).tolist()
    with torch.no_grad():
        session = spec_decode.TargetSession(target)
        session.prefill(prompt)
        with tree_verification(session, tree_mask(parents)[None], depths=torch.tensor(depths)):
            logits, _ = session.verify(tokens, position_ids=torch.tensor(depths) + len(prompt))

        def path(i):
            return path(parents[i]) + [tokens[i]] if i >= 0 else []

        for i in range(len(parents)):
            full = _run(target, torch.cat([prompt, torch.tensor(path(i))])[None]).logits[0, -1]
            torch.testing.assert_close(logits[i], full, msg=f"node {i}")
        kept = [0, 2, 5]                                                 # root, node 2, node 5
        session.keep_path(kept)
        nxt, _ = session.decode(5)
        fresh = _run(target, torch.cat([prompt, torch.tensor([tokens[k] for k in kept] + [5])])[None]).logits[0, -1]
    torch.testing.assert_close(nxt, fresh)


def test_cmr_target_weights_for_each_family(family):
    from fold.spec_decode.retrieval import target_attention_weights

    _, target, prompts, _ = family
    ids = prompts[0][None]
    want = {}
    for dtype in (torch.float64, torch.float32):        # the truth, and what transformers errs in float32
        eager = copy.deepcopy(target).to(dtype)
        eager.config._attn_implementation = "eager"
        with torch.no_grad():
            attentions = _run(eager, ids, output_attentions=True).attentions   # attention layers only, in order
        want[dtype] = attentions[-1][0, :, -1].mean(dim=0)                     # the last one is full in both
    target = _double(target)
    with torch.no_grad():
        session = spec_decode.TargetSession(target)
        _, hidden = session.prefill(ids[0])
        cache = session.cache
        got = target_attention_weights(target, hidden, cache, committed=ids.shape[1], row=ids.shape[1] - 1)
    assert got.dtype == torch.float32                                         # a float32 softmax of float64 logits
    check_close("CMR weights", got, want[torch.float64], want[torch.float32], torch.float32)


# -- drafter side: the blocks against dense re-statements --------------------------------------------

def _rms(x, weight, eps, one_plus=False):
    y = x * (x.pow(2).mean(-1, keepdim=True) + eps) ** -0.5
    return y if weight is None else y * weight


def _rope(x, pos, inv_freq):
    # NeoX halves over the whole last dim (zero frequencies leave their pairs unrotated): x [T, H, d]
    ang = pos.double()[:, None] * inv_freq.double()                     # [T, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _dense_block_logits(config, w, target, features, anchor):
    """Every row's logits of the block [anchor, MASK...] after context features [n, k*H], written from
    the notes (families.md / drafters.md) with the checkpoint's own config.json and weights."""
    gemma = config["architectures"] == ["Gemma4DSparkModel"]
    dflash = config.get("dflash_config", {})
    eps, hidden = config["rms_norm_eps"], config["hidden_size"]
    heads_q = config["num_attention_heads"]
    if gemma:
        d = config["global_head_dim"]
        k_eq_v = config["attention_k_eq_v"]
        heads_kv = config["num_global_key_value_heads"] if k_eq_v else config["num_key_value_heads"]
        rp = config["rope_parameters"]["full_attention"]                 # proportional, partial
        angles = int(rp["partial_rotary_factor"] * d // 2)
        inv_freq = torch.cat([rp["rope_theta"] ** (-torch.arange(0, 2 * angles, 2).double() / d),
                              torch.zeros(d // 2 - angles, dtype=torch.float64)])
        scale = 1.0
    else:
        d, heads_kv = config["head_dim"], config["num_key_value_heads"]
        inv_freq = config["rope_parameters"]["rope_theta"] ** (-torch.arange(0, d, 2).double() / d)
        scale = d ** -0.5
    mask_id = dflash.get("mask_token_id", config.get("mask_token_id"))
    block = dflash.get("block_size", config.get("block_size"))
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    n = features.shape[0]
    ids = torch.tensor([anchor] + [mask_id] * (block - 1))
    if gemma:
        h = w["embed_tokens.weight"][ids] * math.sqrt(hidden)
    else:
        h = target.get_input_embeddings().weight.double()[ids] * dflash.get("input_embedding_scale", 1.0)
    c = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    pos = torch.arange(n + block)
    for i, kind in enumerate(types):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        rows = torch.cat([c, x])
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(block, heads_q, d), w[p + "self_attn.q_norm.weight"],
                 eps)
        k_raw = (rows @ w[p + "self_attn.k_proj.weight"].T).view(-1, heads_kv, d)
        k = _rms(k_raw, w[p + "self_attn.k_norm.weight"], eps)
        if gemma:
            v = _rms(k_raw if k_eq_v else (rows @ w[p + "self_attn.v_proj.weight"].T).view(-1, heads_kv, d), None, eps)
        else:
            v = (rows @ w[p + "self_attn.v_proj.weight"].T).view(-1, heads_kv, d)
        q, k = _rope(q, pos[n:], inv_freq), _rope(k, pos, inv_freq)
        k, v = k.repeat_interleave(heads_q // heads_kv, 1), v.repeat_interleave(heads_q // heads_kv, 1)
        s = torch.einsum("rhd,jhd->hrj", q, k) * scale
        if kind == "sliding_attention":                                   # causal, window counts the current token
            qp, kp = pos[n:, None], pos[None, :]
            s = s.masked_fill(~((kp <= qp) & (qp - kp < config["sliding_window"])), float("-inf"))
        o = torch.einsum("hrj,jhd->rhd", torch.softmax(s, -1), v).reshape(block, -1)
        o = o @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            h = h + _rms(o, w[p + "post_attention_layernorm.weight"], eps)
            m = _rms(h, w[p + "pre_feedforward_layernorm.weight"], eps)
            m = (F.gelu(m @ w[p + "mlp.gate_proj.weight"].T, approximate="tanh") * (m @ w[p + "mlp.up_proj.weight"].T))
            h = (h + _rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_feedforward_layernorm.weight"], eps))
            h = h * w[p + "layer_scalar"]
        else:
            h = h + o
            m = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            h = h + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ \
                w[p + "mlp.down_proj.weight"].T
    out = _rms(h, w["norm.weight"], eps)
    if gemma:
        logits, cap = out @ w["lm_head.weight"].T, config["final_logit_softcapping"]
    else:
        logits = (out @ target.get_output_embeddings().weight.double().T) * dflash.get("output_multiplier", 1.0)
        cap = dflash.get("final_logit_softcapping")
    return torch.tanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("fmt", ["gemma4-dspark", "gemma4-dflash", "zlab-gemma", "zlab-swa"])
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_drafter_block_equals_a_dense_restatement(tmp_path, fmt, k_eq_v):
    from safetensors.torch import load_file

    if fmt.startswith("zlab") and not k_eq_v:
        pytest.skip("attention_k_eq_v is a Gemma4DSparkModel field")
    target = make_target("gemma4", tmp_path / "t", vocab=SMALL_VOCAB)
    path = make_drafter(tmp_path / "d", target, fmt, block_size=4, k_eq_v=k_eq_v)
    drafter = spec_decode.load_drafter(path, target).double()
    target = target.double()
    drafter.bind(target)
    config = json.loads((path / "config.json").read_text())
    weights = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    g = torch.Generator().manual_seed(5)
    features = torch.randn(1, 2 * DRAFTER_WINDOW + 3, 2 * 64, generator=g, dtype=torch.float64)
    state = drafter.new_state(features.shape[1], "cpu", torch.float64)
    drafter.append_context(state, features)
    got = drafter.slot_logits(state, 3, make_read("dflash", drafter.cfg.rope))   # float64 math, float32 logits
    want = _dense_block_logits(config, weights, target, features[0], 3)
    want = want if fmt.startswith("gemma4") else want[1:]
    assert got.shape[0] == (4 if fmt.startswith("gemma4") else 3)        # DeepSpec: every row drafts; z-lab: 1..B-1
    check_close(f"{fmt} block logits", got, want, want, torch.float32)     # only the float32 rounding of the result


def test_gemma4_drafter_rope_is_the_targets_full_attention_rope(tmp_path):
    target = make_target("gemma4", tmp_path / "t", vocab=SMALL_VOCAB)     # global_head_dim 32 = the drafter's
    drafter = spec_decode.load_drafter(make_drafter(tmp_path / "d", target, "gemma4-dspark"), target)
    want = target.model.rotary_emb.full_attention_inv_freq
    assert drafter.cfg.rope.rotary_dim == 32
    torch.testing.assert_close(drafter.cfg.rope.inv_freq, want.float(), rtol=0, atol=0)
    assert (want == 0).sum() == 12                                        # 0.25 of the pairs rotate, the rest do not


# -- load-time errors that name the field ----------------------------------------------------------



@pytest.mark.parametrize("fmt, changes, error, words", [
    ("gemma4-dspark", dict(global_head_dim=None), ValueError, "has no 'global_head_dim'"),
    ("gemma4-dspark", dict(num_global_key_value_heads=None), ValueError, "has no 'num_global_key_value_heads'"),
    ("gemma4-dspark", dict(enable_moe_block=True), ValueError, "enable_moe_block=True is not supported"),
    ("gemma4-dspark", dict(hidden_activation="silu"), ValueError, "hidden_activation 'silu' is not supported"),
    ("gemma4-dspark", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}),
     ValueError, "rope_type 'yarn' of the full-attention layers"),
    ("gemma4-dspark", dict(final_logit_softcapping=-1), ValueError, "final_logit_softcapping must be a finite number"),
    ("gemma4-dspark", dict(attention_k_eq_v=False, num_key_value_heads=1), ValueError,
     "weights do not match the config: missing ['layers.0.self_attn.v_proj.weight'"),
    ("gemma4-dspark", dict(global_head_dim=16), ValueError,
     "weights do not match config.json: ['layers.0.self_attn.k_norm.weight (32,) (config wants (16,))'"),
    ("dspark", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4), ValueError,
     "DeepSpec drafters read every layer as full"),
    ("zlab-swa", dict(use_sliding_window=False), ValueError, "use_sliding_window is False"),
    ("zlab-swa", dict(sliding_window=None), TypeError, "sliding_window must be an int >= 1, got None"),
    ("zlab-swa", dict(layer_types=["sliding_attention"]), ValueError, "layer_types must list"),
    ("zlab-swa", dict(is_causal="yes"), TypeError, "is_causal / dflash_config.causal must be true or false"),
    ("zlab-gemma", dict(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 11, "output_multiplier": "x"}),
     ValueError, "dflash_config.output_multiplier must be a finite number"),
    ("zlab-swa", dict(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 11, "use_swa": True}),
     ValueError, "dflash_config.use_swa"),
])
def test_a_drafter_that_does_not_fit_fails_naming_the_field(tmp_path, fmt, changes, error, words):
    target = make_target("gemma4", tmp_path / "t", vocab=SMALL_VOCAB)
    path = make_drafter(tmp_path / "d", target, fmt)
    rewrite_config(path, **changes)
    with pytest.raises(error) as info:
        spec_decode.load_drafter(path, target)
    assert words in str(info.value)


def test_gemma4_drafter_ignores_the_per_layer_input_fields_of_the_copied_target_config(tmp_path):
    """DeepSpec's Gemma4DSparkModel config is a copy of the target's: a target with per-layer input
    embeddings brings their sizes along, which the block never reads; it loads and drafts the same."""
    target = make_target("gemma4", tmp_path / "t", vocab=SMALL_VOCAB)
    plain = spec_decode.load_drafter(make_drafter(tmp_path / "d", target, "gemma4-dspark"), target)
    path = make_drafter(tmp_path / "e", target, "gemma4-dspark")
    rewrite_config(path, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144)
    copied = spec_decode.load_drafter(path, target)
    assert copied.cfg.num_layers == plain.cfg.num_layers and copied.cfg.head_dim == plain.cfg.head_dim
    prompt = torch.randint(0, SMALL_VOCAB - 1, (20,), generator=torch.Generator().manual_seed(4))[None]
    a = spec_decode.generate(target, plain, prompt, max_new_tokens=8, policy="dflash")
    b = spec_decode.generate(target, copied, prompt, max_new_tokens=8, policy="dflash")
    assert torch.equal(a.sequences, b.sequences) and a.stats["per_sequence"][0]["accepted_per_round"] == \
        b.stats["per_sequence"][0]["accepted_per_round"]
    state_a, state_b = plain.state_dict(), copied.state_dict()
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_sliding_layers_causality_and_window_fields(tmp_path):
    target = make_target("gemma4", tmp_path / "t", vocab=SMALL_VOCAB)
    path = make_drafter(tmp_path / "d", target, "zlab-swa")
    assert spec_decode.load_drafter(path, target).cfg.layer_causal == [True, False]
    rewrite_config(path, is_causal=False)
    cfg = spec_decode.load_drafter(path, target).cfg
    assert cfg.layer_causal == [False, False] and cfg.layer_windows == [DRAFTER_WINDOW, None]
    rewrite_config(path, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 11, "swa_window_size": 3},
                   sliding_window=3, is_causal=None)      # both windows agree (test_config_fields: when they do not)
    cfg = spec_decode.load_drafter(path, target).cfg
    assert cfg.layer_causal == [True, False] and cfg.layer_windows == [3, None]


def test_glide_refuses_sliding_and_linear_targets(tmp_path):
    from tests.spec_decode_fixtures import make_glide

    llama = make_target("llama", tmp_path / "l")
    path = make_glide(tmp_path / "g", llama)
    for kind in ("qwen3_5", "gemma4"):
        target = make_target(kind, tmp_path / kind)
        with pytest.raises(ValueError, match="GLIDE drafter cross-attends"):
            spec_decode.load_drafter(path, target)
