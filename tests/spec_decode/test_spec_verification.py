"""What a verification costs on the target side, without changing its math: a grouped-query target's
cache read once (``fold.spec_decode.swap.grouped_sdpa``), and on a CPU the LM head run only on the rows
acceptance reads (``fold.spec_decode.session.LogitRows``); and the session's verbs (a verification is pending
until the loop commits it)."""

import copy
import dataclasses

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fold import spec_decode
from fold.spec_decode import swap
from fold.spec_decode.session import LogitRows
from fold.spec_decode.target import TargetFacts
from reference.tolerance import check_close
from tests.spec_decode_fixtures import greedy_ar, make_drafter, make_target


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
        out, _ = swap.grouped_sdpa(module, q, k, v, m, scaling=0.25)
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
    out, _ = swap.grouped_sdpa(_Module(g), q, k, v, mask, **kwargs)
    assert calls == [1] and out.shape == ()                  # transformers' own function answered
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", real)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_target("llama", tmp_path_factory.mktemp("target"))          # 4 query heads, 2 K/V heads
    drafter = spec_decode.load_drafter(make_drafter(tmp_path_factory.mktemp("zlab"), target, "zlab"), target)
    return target, drafter


def _count_grouped(monkeypatch):
    rows = []
    real = swap.grouped_sdpa

    def spy(module, query, *args, **kwargs):
        rows.append(query.shape[2])
        return real(module, query, *args, **kwargs)
    monkeypatch.setattr(swap, "grouped_sdpa", spy)
    return rows


def test_verifications_run_grouped_and_stay_lossless(pair, monkeypatch):
    target, drafter = pair
    assert target.config._attn_implementation == "sdpa"
    rows = _count_grouped(monkeypatch)
    ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(3))
    out = spec_decode.generate(target, drafter, ids, max_new_tokens=12, policy="fold", window=8)
    assert rows and max(rows) > 1                            # the verifications went through it
    assert target.config._attn_implementation == "sdpa"      # and the target is given back as it was
    assert out.sequences[0].tolist() == greedy_ar(target, ids[0], 12).tolist()


def test_other_attention_implementations_are_left_alone(pair, monkeypatch):
    target, drafter = pair
    rows = _count_grouped(monkeypatch)
    target.set_attn_implementation("eager")
    try:
        ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(4))
        out = spec_decode.generate(target, drafter, ids, max_new_tokens=8, policy="fold", window=8)
        assert target.config._attn_implementation == "eager"
    finally:
        target.set_attn_implementation("sdpa")
    assert rows == []
    assert out.sequences[0].tolist() == greedy_ar(target, ids[0], 8).tolist()


# -- the LM head on the rows acceptance reads ----------------------------------------------------------

def _head_rows(target):
    """A list that grows by the number of rows each call of ``target``'s LM head computes."""
    rows = []
    target.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    return rows


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_logit_rows_are_the_forwards_rows_computed_when_read(kind, tmp_path):
    target = make_target(kind, tmp_path)
    ids = torch.randint(0, 90, (20,), generator=torch.Generator().manual_seed(0))
    block = torch.randint(0, 90, (6,), generator=torch.Generator().manual_seed(1))
    facts = TargetFacts.probe(target)
    assert facts.plain_head and facts.logits_to_keep                  # probed once, by a two-token forward
    plain, lazy = spec_decode.TargetSession(target, facts=dataclasses.replace(facts, plain_head=False)), \
        spec_decode.TargetSession(target, facts=facts)
    for s in (plain, lazy):
        s.prefill(ids)
    full, _ = plain.verify(block)                                 # [6, V], every row
    assert isinstance(full, torch.Tensor) and full.shape[0] == 6
    rows = _head_rows(target)
    got, _ = lazy.verify(block)
    assert isinstance(got, LogitRows) and len(got) == 6
    assert rows == [1]                                            # the model computed row 0 alone
    for i in (0, 3, 3, 5):
        full64 = full[i].double()
        check_close(f"row {i}", got[i], full64, full[i], torch.float32)
    assert rows == [1, 1, 1]                                      # rows 3 and 5, each once
    with pytest.raises(IndexError):
        got[6]


def test_a_head_with_a_transform_after_it_is_never_read_lazily(tmp_path):
    target = make_target("gemma4", tmp_path)                      # final_logit_softcapping
    s = spec_decode.TargetSession(target)
    assert s.facts.plain_head is False
    s.prefill(torch.arange(12))
    for _ in range(2):
        logits, _ = s.verify(torch.arange(4))
        assert isinstance(logits, torch.Tensor) and logits.shape[0] == 4     # one sequence's rows [T, V]
        s.commit(0)


def test_a_verification_is_pending_until_the_loop_commits_it(pair):
    """Nothing commits implicitly: a forward while a verification is pending is refused, commit keeps
    a prefix of it (checked), and the cache then continues as a fresh run of the committed tokens."""
    target = copy.deepcopy(pair[0]).double()          # continued vs fresh sum in different orders: float64
    ids = torch.randint(0, 90, (15,), generator=torch.Generator().manual_seed(8))
    s = spec_decode.TargetSession(target)
    s.prefill(ids)
    s.verify(torch.tensor([4, 5, 6]))
    assert (s.length, s.pending) == (18, 3)
    for verb, args in (("verify", (torch.tensor([1]),)), ("decode", (3,)), ("prefill", (ids,))):
        with pytest.raises(RuntimeError, match="the last verification \\(3 tokens\\) is not committed"):
            getattr(s, verb)(*args)
    with pytest.raises(ValueError, match="kept must lie in \\[0, 3\\]"):
        s.commit(4)
    s.commit(2)
    assert (s.length, s.pending) == (17, 0)
    with pytest.raises(RuntimeError, match="no verification is pending"):
        s.commit(1)
    logits, _ = s.decode(9)
    fresh, _ = spec_decode.TargetSession(target).prefill(torch.cat([ids, torch.tensor([4, 5, 9])]))
    check_close("continued", logits, fresh, fresh, torch.float64)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_acceptance_reads_rows_in_order_up_to_the_first_rejection(temperature):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=gen) * 3
    drafts = [int(logits[0].argmax()), int(logits[1].argmax()), (int(logits[2].argmax()) + 1) % 40, 7, 8]
    probs = torch.softmax(torch.randn(5, 40, generator=gen), -1)

    class Spy:
        def __init__(self):
            self.read = []

        def __len__(self):
            return len(logits)

        def __getitem__(self, i):
            self.read.append(i)
            return logits[i]

    from fold.spec_decode.generate import accept
    spy = Spy()
    got = accept(drafts, probs, spy, temperature, torch.Generator().manual_seed(9))
    want = accept(drafts, probs, logits, temperature, torch.Generator().manual_seed(9))
    assert got == want
    assert sorted(set(spy.read)) == list(range(got[0] + 1))      # rows 0..a, none after
    if temperature == 0.0:
        assert got == (2, int(logits[2].argmax()))


def test_a_generate_on_a_cpu_pays_the_head_for_the_rows_it_reads(pair, monkeypatch):
    target, drafter = pair
    ids = torch.randint(0, 90, (1, 30), generator=torch.Generator().manual_seed(6))
    want = greedy_ar(target, ids[0], 40)[30:].tolist()
    calls = []

    def oracle(state, anchor, read, temperature=0.0, generator=None, **_):
        """The target's own continuation, wrong at slot (round % 4): rounds accept 0, 1, 2 or all 3."""
        pos = state.length - 30                       # committed entries after the prompt: the anchor's index
        assert want[pos] == anchor
        drafts = want[pos + 1:pos + 4]
        j = len(calls) % 4
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % 90
        calls.append(j)
        return drafts, None
    computed, real = [], LogitRows.__getitem__

    def spy(self, i):
        if i not in self.computed:
            computed.append(i)
        return real(self, i)
    monkeypatch.setattr(drafter, "draft", oracle)
    monkeypatch.setattr(LogitRows, "__getitem__", spy)
    out = spec_decode.generate(target, drafter, ids, max_new_tokens=24, policy="fold", window=8)
    assert out.sequences[0, 30:].tolist() == want[:24]
    per_round = out.stats["per_sequence"][0]["accepted_per_round"]   # accepted drafts + the target's token
    assert set(per_round) == {1, 2, 3, 4}
    # round r reads rows 0..a_r: row 0 came with the forward, rows 1..a_r were computed here, none after
    assert sorted(computed) == sorted(i for a in per_round for i in range(1, a))
