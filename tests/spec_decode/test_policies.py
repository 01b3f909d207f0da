"""Each baseline's context read against a direct, dense reference of that baseline."""

import math

import pytest
import torch
import torch.nn.functional as F

import fold
from fold.spec_decode.policies import make_read, rerope_read, streaming_read, window_read, yarn_factor, yarn_rope
from reference import apply_rope
from reference.tolerance import check_close

N_Q, HQ, HKV, D = 4, 4, 2, 16
# Inputs and references are float64 here: two float64 orders of the same sums differ by ~1e-15, so
# F64 only catches wrong math, never a summation order (float32 results go through check_close).
F64 = dict(rtol=1e-10, atol=1e-10)


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
    torch.testing.assert_close(got, want, **F64)


def test_window_sees_exactly_fold_window(qkv):
    q, k, v = qkv
    window = 9
    n, d_pos = k.shape[1] - N_Q, window + N_Q
    j = torch.arange(k.shape[1])
    logits = _logits(_rot(q[0], torch.arange(n, n + N_Q)), _rot(k[0], j))
    visible = (torch.arange(n, n + N_Q)[:, None] - j[None, :]) < d_pos
    want = _attend(logits.masked_fill(~visible, float("-inf")), v[0])
    torch.testing.assert_close(window_read(q, k, v, rope=ROPE, window=window), want, **F64)


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
    torch.testing.assert_close(got, want, **F64)
    assert scale.min() > 1                                            # the scaling was exercised


def test_yarn_factor_is_the_papers_per_request_rule():
    assert yarn_factor(32000, 1024, 16, 3072) == 33280 / 3072          # ceil(33040 / 256) * 256 = 33280
    assert yarn_factor(100, 28, 16, 4096) == 1.0


def test_yarn_matches_transformers_and_is_identity_at_factor_one():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = fold.Rope.from_theta(10000.0, 64)
    assert yarn_rope(base, 1.0, 4096, 10000.0) is base
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4096})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")            # float32
    ours = yarn_rope(base, 8.0, 4096, 10000.0)
    # the truth: YaRN's ramp (transformers' formula) in float64; every inv_freq divided by the plain
    # float64 one, so the check is relative over frequencies that span four decades
    plain = 10000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    low = max(math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000.0))), 0)
    high = min(math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(10000.0))), 63)
    extrapolate = 1 - ((torch.arange(32, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    truth = plain / 8.0 * (1 - extrapolate) + plain * extrapolate
    check_close("YaRN inv_freq / plain inv_freq", ours.inv_freq / plain, truth / plain, inv_freq / plain, torch.float32)
    assert ours.attention_factor == attention_factor == 0.1 * math.log(8.0) + 1.0


def test_yarn_read_is_plain_attention_under_the_scaled_rope(qkv):
    q, k, v = qkv
    request = dict(prompt_len=50, max_new_tokens=10, block_size=N_Q)
    read = make_read("yarn", ROPE, request=request, reference_len=64, rope_theta=10000.0, backend="torch")
    scaled = yarn_rope(ROPE, yarn_factor(50, 10, N_Q, 64), 64, 10000.0)
    n = k.shape[1] - N_Q
    logits = _logits(_rot(q[0], torch.arange(n, n + N_Q), scaled), _rot(k[0], torch.arange(k.shape[1]), scaled))
    torch.testing.assert_close(read(q, k, v, 0), _attend(logits, v[0]), **F64)


def test_fold_dispatches_to_the_plain_read_while_everything_fits(qkv):
    q, k, v = qkv
    read = make_read("fold", ROPE, request={}, window=k.shape[1], backend="torch")
    plain = make_read("dflash", ROPE, request={}, backend="torch")
    assert torch.equal(read(q, k, v, 0), plain(q, k, v, 0))


@pytest.mark.parametrize("policy", ["nope", "InfLLM"])
def test_unknown_policies_are_refused_by_name(policy):
    with pytest.raises(ValueError, match=repr(policy)):
        make_read(policy, ROPE, request={})


def test_sdpa_cross_check_of_the_dense_helpers(qkv):
    """The helpers above agree with SDPA (so the references are not wrong in the same way)."""
    q, k, v = qkv
    j = torch.arange(k.shape[1])
    qr, kr = _rot(q[0], j[-N_Q:]), _rot(k[0], j)
    want = F.scaled_dot_product_attention(qr.transpose(0, 1), kr.transpose(0, 1).repeat_interleave(2, 0),
                                          v[0].transpose(0, 1).repeat_interleave(2, 0)).transpose(0, 1)[None]
    torch.testing.assert_close(_attend(_logits(qr, kr), v[0]), want, **F64)


def _fold_like_dense(q, k, v, window, old_set, far_distance):
    """One softmax: row r sees its window (j > n + r - D) at true distances and the entries of
    ``old_set`` outside its window at ``far_distance``."""
    n = k.shape[1] - N_Q
    d_pos = window + N_Q
    p = torch.arange(n, n + N_Q)
    j = torch.arange(k.shape[1])
    in_window = (p[:, None] - j[None, :]) < d_pos
    old = torch.zeros(k.shape[1], dtype=torch.bool)
    old[list(old_set)] = True
    true = _logits(_rot(q[0], p), _rot(k[0], j))
    far = _logits(_rot(q[0], torch.full((N_Q,), far_distance)), k[0])
    logits = torch.where(in_window, true, torch.where(old[None, :] & ~in_window, far, float("-inf")))
    return _attend(logits, v[0])


def test_infllm_with_every_block_selected_reads_all_old_entries_at_d_minus_one(qkv):
    from fold.spec_decode.retrieval import InfLLMRead

    q, k, v = qkv
    window = 9
    read = InfLLMRead(ROPE, window=window, block=8, init=4, topk=100, repr_topk=2)
    want = _fold_like_dense(q, k, v, window, range(k.shape[1]), window + N_Q - 1)
    torch.testing.assert_close(read(q, k, v, 0), want, **F64)


def test_infllm_retrieves_the_block_that_matches_the_query(qkv):
    from fold.spec_decode.retrieval import InfLLMRead

    q, k, v = qkv
    window, block, init = 9, 8, 4
    n = k.shape[1] - N_Q                                   # 56 committed; old for every row: j < 44
    d_pos = window + N_Q
    k = k.clone()
    q_far = _rot(q[0], torch.full((N_Q,), d_pos - 1)).mean(dim=0)           # [Hq, d]
    k[0, init + 2 * block:init + 3 * block] = 3 * q_far.view(HKV, HQ // HKV, D).mean(dim=1)  # block 2 aligned
    read = InfLLMRead(ROPE, window=window, block=block, init=init, topk=1, repr_topk=2)
    old_end = n - d_pos + N_Q
    n_blocks = (n - d_pos + 1 - init) // block
    chosen = list(range(init)) + list(range(init + 2 * block, init + 3 * block)) + \
        list(range(init + n_blocks * block, old_end))
    want = _fold_like_dense(q, k, v, window, chosen, d_pos - 1)
    torch.testing.assert_close(read(q, k, v, 0), want, **F64)


def test_infllm_accumulates_window_attention_for_representatives(qkv):
    from fold.spec_decode.retrieval import InfLLMRead

    q, k, v = qkv
    read = InfLLMRead(ROPE, window=9, block=8, init=4, topk=1, repr_topk=2)
    read(q, k, v, 3)
    n = k.shape[1] - N_Q
    scores = read.scores[3]
    in_window = torch.arange(k.shape[1]) > n - (9 + N_Q)
    committed = torch.arange(k.shape[1]) < n
    assert (scores[:, in_window & committed] > 0).all() and (scores[:, ~(in_window & committed)] == 0).all()


def test_cmr_first_draft_reads_the_most_recent_chunks_renumbered(qkv):
    from fold.spec_decode.retrieval import CMRRead

    q, k, v = qkv
    read = CMRRead(ROPE, chunk=8, top=3, every=8, backend="torch")
    n = k.shape[1] - N_Q                                   # 56 entries = 7 chunks
    kept = list(range(32, 56)) + list(range(n, k.shape[1]))
    virtual = torch.arange(len(kept))
    want = _attend(_logits(_rot(q[0], virtual[-N_Q:]), _rot(k[0, kept], virtual)), v[0, kept])
    torch.testing.assert_close(read(q, k, v, 0), want, **F64)


def test_cmr_selects_chunks_by_mean_weight_and_adds_new_ones():
    from fold.spec_decode.retrieval import CMRRead

    read = CMRRead(ROPE, chunk=4, top=2)
    weights = torch.zeros(18)                              # chunks 0..3 full, chunk 4 partial (2 entries)
    weights[5] = 0.5                                       # chunk 1: mean 0.125
    weights[16] = 0.2                                      # chunk 4: mean 0.1 (partial: over 2 entries)
    weights[9:12] = 0.03                                   # chunk 2: mean 0.0225
    read.select(weights)
    assert read.selected == {1, 4}
    assert read.entries(18).tolist() == [4, 5, 6, 7, 16, 17]
    assert read.entries(21).tolist() == [4, 5, 6, 7, 16, 17, 18, 19, 20]   # chunk 5 started: added


def test_cmr_target_weights_match_transformers_attention(tmp_path):
    pytest.importorskip("transformers")
    from fold.spec_decode import TargetSession
    from fold.spec_decode.retrieval import target_attention_weights
    from tests.spec_decode_fixtures import make_target

    target = make_target("qwen3", tmp_path / "t")
    ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(0))
    session = TargetSession(target)
    _, hidden = session.prefill(ids[0])
    cache = session.cache
    got = target_attention_weights(target, hidden, cache, committed=30, row=29)
    target.config._attn_implementation = "eager"
    want_lp = target(ids, output_attentions=True).attentions[-1][0, :, -1].mean(dim=0)      # float32
    want = target.double()(ids, output_attentions=True).attentions[-1][0, :, -1].mean(dim=0)  # the truth
    check_close("CMR weights", got, want, want_lp, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dflash_read_keeps_rotated_keys_across_rounds(dtype):
    # the context grows round by round (and past the first buffer); every call must equal the
    # dense read of that round, block rows included, layers kept apart
    g = torch.Generator().manual_seed(1)
    read = make_read("dflash", ROPE, request={})
    k_all = torch.randn(1, 2600, HKV, D, generator=g, dtype=dtype)
    v_all = torch.randn(1, 2600, HKV, D, generator=g, dtype=dtype)
    for n in (3, 9, 40, 1100, 1101, 2590):
        for layer in (0, 1):
            q = torch.randn(1, N_Q, HQ, D, generator=g, dtype=dtype)
            k = torch.cat([k_all[:, :n], torch.randn(1, N_Q, HKV, D, generator=g, dtype=dtype)], 1)
            v = torch.cat([v_all[:, :n], torch.randn(1, N_Q, HKV, D, generator=g, dtype=dtype)], 1)
            q64, k64, v64 = q[0].double(), k[0].double(), v[0].double()
            expected = _attend(_logits(_rot(q64, torch.arange(n, n + N_Q)), _rot(k64, torch.arange(n + N_Q))), v64)
            same_dtype = _attend(_logits(_rot(q[0], torch.arange(n, n + N_Q)), _rot(k[0], torch.arange(n + N_Q))), v[0])
            check_close(f"dflash read n={n} layer {layer}", read(q, k, v, layer), expected, same_dtype, dtype)
