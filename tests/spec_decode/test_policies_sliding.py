"""The per-layer rules of Appendix B.3 for sliding-window drafter layers, each against a dense reference.

A sliding layer (window ``Ws`` counting the current token) is causal over the block unless the
checkpoint says otherwise. Every reference below is one dense computation in float64: logits of
every (row, entry) pair at the positions the rule assigns, a mask, a softmax (or FOLD's two masses).
"""

import pytest
import torch

import fold
from fold.spec_decode.policies import BUILT, make_read
from reference import apply_rope

N_Q, HQ, HKV, D = 4, 4, 2, 16
WS = 6              # the layer's sliding window
W = 9               # the policy's window (FOLD, ReRoPE)
ROPE = fold.Rope.from_theta(10000.0, D)
REQUEST = dict(prompt_len=50, max_new_tokens=10, block_size=N_Q)
# float64 on both sides: two float64 orders of the same sums differ by ~1e-15, so F64 only catches
# wrong math, never a summation order
F64 = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    length = 40
    return (torch.randn(1, N_Q, HQ, D, generator=g, dtype=torch.float64),
            torch.randn(1, length, HKV, D, generator=g, dtype=torch.float64),
            torch.randn(1, length, HKV, D, generator=g, dtype=torch.float64))


def _rot(x, pos):
    return apply_rope(x, torch.as_tensor(pos)[:, None], ROPE.inv_freq, rotary_dim=ROPE.rotary_dim)


def _logits(q_rows, keys):
    # q_rows [n_q, Hq, d], keys [N, Hkv, d] -> [Hq, n_q, N]
    return torch.einsum("rhd,jhd->hrj", q_rows, keys.repeat_interleave(HQ // HKV, 1)) * D ** -0.5


def _values(v):
    return v.repeat_interleave(HQ // HKV, 1)                                   # [N, Hq, d]


def _native_mask(n, length, causal, window=WS):
    p = (n + torch.arange(N_Q))[:, None]
    j = torch.arange(length)[None, :]
    return ((p - j) < window) & ((j <= p) if causal else ((j - p) < window))


def _native_dense(q, k, v, causal):
    n = k.shape[1] - N_Q
    s = _logits(_rot(q[0], torch.arange(n, n + N_Q)), _rot(k[0], torch.arange(k.shape[1])))
    s = s.masked_fill(~_native_mask(n, k.shape[1], causal), float("-inf"))
    return torch.einsum("hrj,jhd->rhd", torch.softmax(s, -1), _values(v[0]))[None]


def _outside_native(n, length, causal):
    """Context entries outside each row's native window: j <= p - Ws (and j < n)."""
    p = (n + torch.arange(N_Q))[:, None]
    j = torch.arange(length)[None, :]
    return ((p - j) >= WS) & (j < n)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("policy", ["dflash", "window", "streaming", "yarn", "infllm"])
def test_policies_that_change_only_the_full_layer_keep_the_native_sliding_read(qkv, policy, causal):
    q, k, v = qkv
    read = make_read(policy, ROPE, request=REQUEST, window=W, sinks=2, recent=5, reference_len=16,
                     infllm_block=4, infllm_init=2, infllm_topk=1, backend="torch")
    got = read.sliding(q, k, v, 0, sliding_window=WS, causal=causal)
    torch.testing.assert_close(got, _native_dense(q, k, v, causal), **F64)


def test_the_native_causal_read_is_causal_within_the_block(qkv):
    q, k, v = qkv
    read = make_read("dflash", ROPE)
    k2, v2 = k.clone(), v.clone()
    k2[0, -1] += 1.0                                       # the last block row's key and value
    v2[0, -1] += 1.0
    a = read.sliding(q, k, v, 0, sliding_window=WS, causal=True)
    b = read.sliding(q, k2, v2, 0, sliding_window=WS, causal=True)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])
    c = read.sliding(q, k2, v2, 0, sliding_window=WS, causal=False)
    assert not torch.equal(c[:, 0], read.sliding(q, k, v, 0, sliding_window=WS, causal=False)[:, 0])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_fold_keeps_the_native_window_and_adds_far_memory_at_the_shared_position(qkv, causal, alpha):
    """Local branch: the native window at true positions. Far memory: every context entry outside
    it, at distance D + r (D = W + n_q, the full layers' far position), sharpened by alpha, merged
    by the masses Z_N and Z_F = (sum exp(alpha f)) ** (1 / alpha)."""
    q, k, v = qkv
    n, length = k.shape[1] - N_Q, k.shape[1]
    local = _logits(_rot(q[0], torch.arange(n, n + N_Q)), _rot(k[0], torch.arange(length)))
    local = local.masked_fill(~_native_mask(n, length, causal), float("-inf"))
    far = _logits(_rot(q[0], W + N_Q + torch.arange(N_Q)), k[0])
    far = far.masked_fill(~_outside_native(n, length, causal), float("-inf"))
    z_n = torch.logsumexp(local, -1)                                        # log Z_N [Hq, n_q]
    z_f = torch.logsumexp(alpha * far, -1) / alpha                          # log Z_F
    o_n = torch.einsum("hrj,jhd->hrd", torch.softmax(local, -1), _values(v[0]))
    o_f = torch.einsum("hrj,jhd->hrd", torch.softmax(alpha * far, -1), _values(v[0]))
    w_n = torch.sigmoid(z_n - z_f)[..., None]
    want = (w_n * o_n + (1 - w_n) * o_f).transpose(0, 1)[None]
    read = make_read("fold", ROPE, window=W, alpha=alpha, backend="torch")
    got = read.sliding(q, k, v, 0, sliding_window=WS, causal=causal)
    torch.testing.assert_close(got, want, **F64)
    assert _outside_native(n, length, causal).any(1).all()                 # every row had far memory


def test_fold_on_a_sliding_layer_is_its_native_read_while_nothing_is_outside_the_window(qkv):
    q, k, v = qkv
    short_k, short_v = k[:, :WS + 1 - N_Q + 1], v[:, :WS + 1 - N_Q + 1]    # n + n_q - 1 < Ws: nothing far
    got = make_read("fold", ROPE, window=W).sliding(q, short_k, short_v, 0, sliding_window=WS, causal=True)
    torch.testing.assert_close(got, _native_dense(q, short_k, short_v, True), **F64)


@pytest.mark.parametrize("causal", [True, False])
def test_rerope_keeps_the_native_window_and_puts_older_entries_at_distance_d(qkv, causal):
    import math

    q, k, v = qkv
    n, length = k.shape[1] - N_Q, k.shape[1]
    training_length = 16
    p = torch.arange(n, n + N_Q)
    qs = q[0] * (torch.log(p.double() + 1) / math.log(training_length)).clamp(min=1)[:, None, None]
    local = _logits(_rot(qs, p), _rot(k[0], torch.arange(length)))
    older = _logits(_rot(qs, torch.full((N_Q,), W + N_Q)), k[0])            # distance D from every row
    s = torch.where(_native_mask(n, length, causal), local,
                    torch.where(_outside_native(n, length, causal), older, float("-inf")))
    want = torch.einsum("hrj,jhd->rhd", torch.softmax(s, -1), _values(v[0]))[None]   # one softmax
    read = make_read("rerope", ROPE, window=W, training_length=training_length, backend="torch")
    got = read.sliding(q, k, v, 0, sliding_window=WS, causal=causal)
    torch.testing.assert_close(got, want, **F64)


def test_cmr_sliding_layers_read_the_selection_renumbered_with_their_window(qkv):
    q, k, v = qkv
    n = k.shape[1] - N_Q                                                    # 36 entries = 9 chunks of 4
    read = make_read("cmr", ROPE, cmr_chunk=4, cmr_top=3, backend="torch")
    kept = list(range(24, 36)) + list(range(n, k.shape[1]))                 # the 3 most recent chunks, then the block
    sel_k, sel_v = k[:, kept], v[:, kept]
    got = read.sliding(q, k, v, 0, sliding_window=WS, causal=True)
    torch.testing.assert_close(got, _native_dense(q, sel_k, sel_v, True), **F64)
    full = read(q, k, v, 1)                                                 # the full layer: the same selection
    virtual = torch.arange(len(kept))
    s = _logits(_rot(q[0], virtual[-N_Q:]), _rot(sel_k[0], virtual))
    want = torch.einsum("hrj,jhd->rhd", torch.softmax(s, -1), _values(sel_v[0]))[None]
    torch.testing.assert_close(full, want, **F64)


def test_every_built_policy_has_a_sliding_rule(qkv):
    q, k, v = qkv
    for policy in BUILT:
        read = make_read(policy, ROPE, request=REQUEST, window=W, backend="torch")
        out = read.sliding(q, k, v, 0, sliding_window=WS, causal=True)
        assert out.shape == q.shape and bool(torch.isfinite(out).all())
