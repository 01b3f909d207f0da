"""A verification's target attention reads grouped-query K/V once (``_hf.grouped_sdpa``), with
transformers' SDPA math, and only where transformers itself would have copied them."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fold import spec
from fold.spec import _hf
from reference.tolerance import check_close
from tests.spec_fixtures import greedy_ar, make_drafter, make_target


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(b, hkv, g, t, n, dtype, seed=0):
    """The same values in every dtype (drawn in float64)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, hkv * g, t, 16), (b, hkv, n + t, 16), (b, hkv, n + t, 16)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _verification_mask(b, t, n, window=None):
    """What SDPA's mask function gives a forward of ``t`` rows after ``n`` cached entries: [b, 1, t, n + t]."""
    rows, cols = torch.arange(n, n + t)[:, None], torch.arange(n + t)[None]
    visible = cols <= rows
    if window is not None:
        visible &= rows - cols < window
    return visible.expand(b, 1, t, n + t)


@pytest.mark.parametrize("b,hkv,g,t,n", [(1, 3, 3, 9, 40), (2, 2, 2, 5, 17), (1, 1, 4, 3, 8), (2, 4, 3, 1 + 6, 0)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "sliding", "per-row-batch"])
def test_grouped_sdpa_matches_transformers(b, hkv, g, t, n, mask_kind):
    mask = _verification_mask(b, t, n, window=4 if mask_kind == "sliding" else None)
    if mask_kind == "float":
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    if mask_kind == "per-row-batch":                       # rows of the batch see different entries
        mask = mask.clone()
        mask[-1, :, :, : max(1, n // 2)] = False
    module = _Module(g)
    outs = {}
    for dtype in (torch.float64, torch.float32):
        q, k, v = _inputs(b, hkv, g, t, n, dtype)
        m = mask if mask.dtype == torch.bool else mask.to(dtype)
        ref, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.25)
        out, _ = _hf.grouped_sdpa(module, q, k, v, m, scaling=0.25)
        assert out.shape == ref.shape == (b, t, hkv * g, 16)
        outs[dtype] = (ref, out)
    check_close("grouped_sdpa float64", outs[torch.float64][1], outs[torch.float64][0], outs[torch.float32][0],
                torch.float32)
    check_close("grouped_sdpa float32", outs[torch.float32][1], outs[torch.float64][0], outs[torch.float32][0],
                torch.float32)


@pytest.mark.parametrize("case", ["one row", "no mask", "no grouping", "per-head mask", "softcap"])
def test_grouped_sdpa_hands_other_cases_to_transformers(case, monkeypatch):
    b, hkv, g, t, n = 1, 2, 3, 4, 10
    if case == "one row":
        t = 1
    if case == "no grouping":
        g = 1
    q, k, v = _inputs(b, hkv, g, t, n, torch.float64)
    mask = None if case == "no mask" else _verification_mask(b, t, n)
    if case == "per-head mask":
        mask = mask.expand(b, hkv * g, t, n + t)
    kwargs = {"softcap": 30.0} if case == "softcap" else {}
    calls = []
    import transformers.integrations.sdpa_attention as sdpa_module
    real = sdpa_module.sdpa_attention_forward
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward",
                        lambda *a, **kw: calls.append(1) or (torch.zeros(()), None))
    out, _ = _hf.grouped_sdpa(_Module(g), q, k, v, mask, **kwargs)
    assert calls == [1] and out.shape == ()                  # transformers' own function answered
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", real)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target("llama", tmp_path_factory.mktemp("target"))          # 4 query heads, 2 K/V heads
    drafter = spec.load_drafter(make_drafter(tmp_path_factory.mktemp("zlab"), target, "zlab"), target)
    return target, drafter


def _count_grouped(monkeypatch):
    rows = []
    real = _hf.grouped_sdpa

    def spy(module, query, *args, **kwargs):
        rows.append(query.shape[2])
        return real(module, query, *args, **kwargs)
    monkeypatch.setattr(_hf, "grouped_sdpa", spy)
    return rows


def test_verifications_run_grouped_and_stay_lossless(pair, monkeypatch):
    target, drafter = pair
    assert target.config._attn_implementation == "sdpa"
    rows = _count_grouped(monkeypatch)
    ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(3))
    out = spec.generate(target, drafter, ids, max_new_tokens=12, policy="fold", window=8)
    assert rows and max(rows) > 1                            # the verifications went through it
    assert target.config._attn_implementation == "sdpa"      # and the target is given back as it was
    assert out.sequences[0].tolist() == greedy_ar(target, ids[0], 12).tolist()


def test_other_attention_implementations_are_left_alone(pair, monkeypatch):
    target, drafter = pair
    rows = _count_grouped(monkeypatch)
    target.set_attn_implementation("eager")
    try:
        ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(4))
        out = spec.generate(target, drafter, ids, max_new_tokens=8, policy="fold", window=8)
        assert target.config._attn_implementation == "eager"
    finally:
        target.set_attn_implementation("sdpa")
    assert rows == []
    assert out.sequences[0].tolist() == greedy_ar(target, ids[0], 8).tolist()
