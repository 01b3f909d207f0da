"""Each baseline's context read against a direct, dense reference of that baseline."""

import math

import pytest
import torch
import torch.nn.functional as F

import fold
from fold.spec.policies import make_read, rerope_read, streaming_read, window_read, yarn_factor, yarn_rope
from reference import apply_rope

N_Q, HQ, HKV, D = 4, 4, 2, 16


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    length = 60
    q = torch.randn(1, N_Q, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, length, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, length, HKV, D, generator=g, dtype=torch.float64)
    return q, k, v


ROPE = fold.Rope.from_theta(10000.0, D)


def _rot(x, pos, rope=ROPE):
    return apply_rope(x, torch.as_tensor(pos)[:, None], rope.inv_freq, rotary_dim=rope.rotary_dim,
                      attention_factor=rope.attention_factor)


def _attend(logits, v):
    # logits [Hq, n_q, N], v [N, Hkv, d] -> [1, n_q, Hq, d]
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hrj,jhd->rhd", p, v.repeat_interleave(HQ // HKV, 1))[None]


def _logits(q_rows, keys):
    # q_rows [n_q, Hq, d], keys [N, Hkv, d]
    return torch.einsum("rhd,jhd->hrj", q_rows, keys.repeat_interleave(HQ // HKV, 1)) * D ** -0.5


def test_streaming_keeps_sinks_and_recent_renumbered(qkv):
    q, k, v = qkv
    sinks, recent = 3, 20
    n = k.shape[1] - N_Q
    kept = list(range(sinks)) + list(range(n - recent, k.shape[1]))
    virtual = torch.arange(len(kept))                          # renumbered consecutively, block last
    logits = _logits(_rot(q[0], virtual[-N_Q:]), _rot(k[0, kept], virtual))
    want = _attend(logits, v[0, kept])
    got = streaming_read(q, k, v, rope=ROPE, sinks=sinks, recent=recent, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_window_sees_exactly_fold_window(qkv):
    q, k, v = qkv
    window = 9
    n, d_pos = k.shape[1] - N_Q, window + N_Q
    j = torch.arange(k.shape[1])
    logits = _logits(_rot(q[0], torch.arange(n, n + N_Q)), _rot(k[0], j))
    visible = (torch.arange(n, n + N_Q)[:, None] - j[None, :]) < d_pos
    want = _attend(logits.masked_fill(~visible, float("-inf")), v[0])
    torch.testing.assert_close(window_read(q, k, v, rope=ROPE, window=window), want, rtol=1e-10, atol=1e-10)


def test_rerope_caps_distances_at_d_and_scales_queries(qkv):
    q, k, v = qkv
    window, training_length = 9, 16
    n, d_pos = k.shape[1] - N_Q, window + N_Q
    p = torch.arange(n, n + N_Q)
    scale = (torch.log(p.double() + 1) / math.log(training_length)).clamp(min=1)
    qs = q[0] * scale[:, None, None]
    j = torch.arange(k.shape[1])
    in_window = (p[:, None] - j[None, :]) < d_pos
    true = _logits(_rot(qs, p), _rot(k[0], j))
    capped = _logits(_rot(qs, torch.full((N_Q,), d_pos)), k[0])       # distance exactly D for every row
    want = _attend(torch.where(in_window, true, capped), v[0])         # one softmax
    got = rerope_read(q, k, v, rope=ROPE, window=window, training_length=training_length)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert scale.min() > 1                                            # the scaling was exercised


def test_yarn_factor_is_the_papers_per_request_rule():
    assert yarn_factor(32000, 1024, 16, 3072) == pytest.approx(33280 / 3072)
    assert yarn_factor(100, 28, 16, 4096) == 1.0


def test_yarn_matches_transformers_and_is_identity_at_factor_one():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = fold.Rope.from_theta(10000.0, 64)
    assert yarn_rope(base, 1.0, 4096, 10000.0) is base
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4096})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = yarn_rope(base, 8.0, 4096, 10000.0)
    torch.testing.assert_close(ours.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(attention_factor)


def test_yarn_read_is_plain_attention_under_the_scaled_rope(qkv):
    q, k, v = qkv
    request = dict(prompt_len=50, max_new_tokens=10, block_size=N_Q)
    read = make_read("yarn", ROPE, request=request, reference_len=64, rope_theta=10000.0, backend="torch")
    scaled = yarn_rope(ROPE, yarn_factor(50, 10, N_Q, 64), 64, 10000.0)
    n = k.shape[1] - N_Q
    logits = _logits(_rot(q[0], torch.arange(n, n + N_Q), scaled), _rot(k[0], torch.arange(k.shape[1]), scaled))
    torch.testing.assert_close(read(q, k, v, 0), _attend(logits, v[0]), rtol=1e-10, atol=1e-10)


def test_fold_dispatches_to_the_plain_read_while_everything_fits(qkv):
    q, k, v = qkv
    read = make_read("fold", ROPE, request={}, window=k.shape[1], backend="torch")
    plain = make_read("dflash", ROPE, request={}, backend="torch")
    assert torch.equal(read(q, k, v, 0), plain(q, k, v, 0))


@pytest.mark.parametrize("policy", ["infllm", "cmr", "nope"])
def test_unbuilt_or_unknown_policies_are_refused_by_name(policy):
    with pytest.raises(ValueError, match=repr(policy)):
        make_read(policy, ROPE, request={})


def test_sdpa_cross_check_of_the_dense_helpers(qkv):
    """The helpers above agree with SDPA (so the references are not wrong in the same way)."""
    q, k, v = qkv
    j = torch.arange(k.shape[1])
    qr, kr = _rot(q[0], j[-N_Q:]), _rot(k[0], j)
    want = F.scaled_dot_product_attention(qr.transpose(0, 1), kr.transpose(0, 1).repeat_interleave(2, 0),
                                          v[0].transpose(0, 1).repeat_interleave(2, 0)).transpose(0, 1)[None]
    torch.testing.assert_close(_attend(_logits(qr, kr), v[0]), want)
