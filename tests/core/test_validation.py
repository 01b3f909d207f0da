"""Bad input to fold.attention raises a clear error naming the argument."""

import pytest
import torch

import fold
from tests.helpers import Case, kwargs_of, make_inputs

CASE = Case(batch=2, n_q=4, heads_kv=2, group=2, head_dim=32, rotary_dim=32, max_len=40, window=8)


def _call(**override):
    q, k, v, _ = make_inputs(CASE)
    args = dict(q=q, k=k, v=v, **kwargs_of(CASE, None))
    args.update(override)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return fold.attention(q, k, v, **args)


def _shape(x_name, shape, dtype=torch.float32):
    return {x_name: torch.randn(shape, dtype=dtype)}


BAD = [
    # (override, error type, words the message must contain)
    (dict(q=torch.randn(2, 4, 4)), ValueError, "q must have shape [batch, n_q, heads_q, head_dim]"),
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    (dict(k=torch.randn(2, 40, 2, 16)), ValueError, "k must have shape [batch=2, max_len, heads_kv, head_dim=32]"),
    (dict(k=torch.randn(3, 40, 2, 32)), ValueError, "k must have shape [batch=2"),
    (dict(v=torch.randn(2, 39, 2, 32)), ValueError, "v must have the shape of k"),
    (dict(k=torch.randn(2, 40, 3, 32), v=torch.randn(2, 40, 3, 32)), ValueError, "heads_q=4 (q.shape[2]) must be a multiple of heads_kv=3"),
    (dict(k=torch.randn(2, 3, 2, 32), v=torch.randn(2, 3, 2, 32)), ValueError, "the cache must hold at least n_q=4 entries"),
    (dict(q=torch.randn(2, 4, 4, 32).to(torch.int32)), TypeError, "q must be float16, bfloat16, float32 or float64"),
    (dict(v=torch.randn(2, 40, 2, 32, dtype=torch.float16)), TypeError, "v must have q's dtype"),
    (dict(cache_seqlens=torch.tensor([3, 40])), ValueError, "cache_seqlens must lie in [n_q=4, max_len=40]"),
    (dict(cache_seqlens=torch.tensor([4, 41])), ValueError, "cache_seqlens must lie in [n_q=4, max_len=40]"),
    (dict(cache_seqlens=torch.tensor([4, 5, 6])), ValueError, "cache_seqlens must have shape [batch=2]"),
    (dict(cache_seqlens=torch.tensor([4.0, 5.0])), TypeError, "cache_seqlens must be int32 or int64"),
    (dict(cache_seqlens="40"), TypeError, "cache_seqlens must be a [batch] integer tensor"),
    (dict(window=-1), ValueError, "window must be >= 0"),
    (dict(window=2.5), TypeError, "window must be an int"),
    (dict(window=True), TypeError, "window must be an int"),
    (dict(alpha=0.5), ValueError, "alpha must be finite and in [1, 10000]"),
    (dict(alpha=float("inf")), ValueError, "alpha must be finite and in [1, 10000]"),
    (dict(alpha=float("nan")), ValueError, "alpha must be finite and in [1, 10000]"),
    (dict(alpha="2"), TypeError, "alpha must be a real number"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and > 0"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite and > 0"),
    (dict(rope=fold.Rope.from_theta(10000.0, 64)), ValueError, "rope.rotary_dim=64 must be <= head_dim=32"),
    (dict(rope="rope"), TypeError, "rope must be a fold.Rope"),
    (dict(keys_rotated=1), TypeError, "keys_rotated must be a bool"),
    (dict(queries_rotated=1), TypeError, "queries_rotated must be a bool"),
    (dict(return_lse=None), TypeError, "return_lse must be a bool"),
    (dict(backend="cuda"), ValueError, "backend must be one of ('auto', 'torch', 'triton')"),
    (dict(far_position="row"), ValueError, "far_position must be one of ('shared', 'fixed_distance', 'none')"),
    (dict(sliding_window=3), ValueError, "sliding_window must be >= n_q=4"),
    (dict(sliding_window=8.0), TypeError, "sliding_window must be an int or None"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(k_scale=0.0), ValueError, "k_scale must be finite and > 0"),
    (dict(v_scale=torch.tensor(2.0)), TypeError, "v_scale must be a real number or None (a float, not a tensor"),
    (dict(k=torch.randn(2, 40, 2, 32).to(torch.float8_e4m3fn)), TypeError,
     "v must have k's FP8 dtype torch.float8_e4m3fn"),
    (dict(k=torch.randn(2, 40, 2, 32).to(torch.float8_e4m3fn), v=torch.randn(2, 40, 2, 32).to(torch.float8_e5m2)),
     TypeError, "v must have k's FP8 dtype"),
    (dict(v=torch.randn(2, 40, 2, 32).to(torch.float8_e5m2)), TypeError,
     "v must have q's dtype torch.float32 or, for an FP8 cache, both one of"),
]


@pytest.mark.parametrize("override, error, words", BAD, ids=[w[:40] for _, _, w in BAD])
def test_bad_input_raises_a_clear_error(override, error, words):
    with pytest.raises(error) as info:
        _call(**override)
    assert words in str(info.value)


def test_triton_refuses_float64():
    with pytest.raises(TypeError, match="backend='triton' takes float16, bfloat16 or float32"):
        _call(q=torch.randn(2, 4, 4, 32, dtype=torch.float64), k=torch.randn(2, 40, 2, 32, dtype=torch.float64),
              v=torch.randn(2, 40, 2, 32, dtype=torch.float64), backend="triton")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        _call(backend="triton")


def test_cache_seqlens_as_a_list_is_accepted():
    a = _call(cache_seqlens=[40, 17])
    b = _call(cache_seqlens=torch.tensor([40, 17]))
    assert torch.equal(a, b)


@pytest.mark.parametrize("args, error, words", [
    (dict(inv_freq=[1.0]), TypeError, "inv_freq must be a torch.Tensor"),
    (dict(inv_freq=torch.ones(2, 2)), ValueError, "inv_freq must have shape [rotary_dim / 2]"),
    (dict(inv_freq=torch.ones(4), rotary_dim=7), ValueError, "rotary_dim must be a positive even number, got 7"),
    (dict(inv_freq=torch.ones(4), rotary_dim=6), ValueError, "rotary_dim=6 needs inv_freq of shape [3]"),
    (dict(inv_freq=torch.ones(4), attention_factor=0.0), ValueError, "attention_factor must be finite and > 0"),
    (dict(inv_freq=torch.tensor([1.0, float("nan")])), ValueError, "inv_freq must hold finite"),
])
def test_bad_rope_raises(args, error, words):
    with pytest.raises(error) as info:
        fold.Rope(**args)
    assert words in str(info.value)


def test_from_theta_rejects_odd_or_too_large_rotary_dim():
    with pytest.raises(ValueError, match="rotary_dim must be even and in"):
        fold.Rope.from_theta(10000.0, 64, rotary_dim=33)
    with pytest.raises(ValueError, match="rotary_dim must be even and in"):
        fold.Rope.from_theta(10000.0, 64, rotary_dim=66)


@pytest.mark.parametrize("call, error, words", [
    (lambda: fold.Rope.from_theta("x", 16), TypeError, "theta must be a real number"),
    (lambda: fold.Rope(torch.ones(4), attention_factor="x"), TypeError, "attention_factor must be a real number"),
    (lambda: fold.Rope.from_config(type("C", (), {"rope_theta": 1e4})()), ValueError, "config has no head_dim"),
    (lambda: fold.merge_states(torch.zeros(2, 3), torch.zeros(2)), TypeError, "outputs and lses must be lists"),
])
def test_other_public_entry_points_name_the_bad_argument(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(groups=[[1.0, float("nan")]]), ValueError, "every value must be finite"),
    (dict(groups="ab"), TypeError, "groups must be a list of lists"),
    (dict(groups=[[1.0, 2.0]], confidence=1.5), ValueError, "confidence must be a float in"),
    (dict(groups=[[1.0, 2.0]], n_resamples=0), ValueError, "n_resamples must be a positive int"),
])
def test_bootstrap_ci_checks_its_arguments(kwargs, error, words):
    from fold import spec_decode

    with pytest.raises(error, match=words):
        spec_decode.bootstrap_ci(**kwargs)


def test_speedup_needs_the_same_sequences():
    from fold import spec_decode
    from fold.spec_decode.generate import GenerateResult

    one = GenerateResult(torch.zeros(1, 1), 1.0, dict(per_sequence=[dict(tpot_s=1.0)]))
    two = GenerateResult(torch.zeros(2, 1), 1.0, dict(per_sequence=[dict(tpot_s=1.0)] * 2))
    with pytest.raises(ValueError, match="the same sequences"):
        spec_decode.per_sequence_speedup(one, two)
