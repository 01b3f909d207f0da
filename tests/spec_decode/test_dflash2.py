"""z-lab DFlash 2 (``DFlash2DraftModel``) in ``fold.spec_decode``: the published layout loads, the block
(two dynamic convolutions per layer) and the candidate selector equal upstream's modules
(``dflash==0.1.0``, float64), and the loop is lossless with it under every policy, greedy and sampling.

The comparisons with upstream skip without it, except under ``CI=true``, where its absence fails.
"""

import copy
import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fold import spec_decode
from fold.spec_decode.drafter import dynamic_causal_conv
from fold.spec_decode.generate import accept
from fold.spec_decode.policies import make_read
from reference.tolerance import check_close
from tests.spec_decode_fixtures import (DFLASH2_SIZES, DRAFTER_WINDOW, OPTIONS, SAMPLING_VOCAB, assert_follows,
                                        greedy_ar, make_dflash2, make_target, padded_batch, rewrite_config)
from tests.upstream_fixtures import import_upstream, upstream_drafter

SMALL_VOCAB = 16


@pytest.fixture(scope="module")
def upstream():
    return import_upstream()


@pytest.fixture(scope="module")
def target64(tmp_path_factory):
    return make_target("qwen3", tmp_path_factory.mktemp("t64")).double()


@pytest.fixture(scope="module")
def target32(target64):
    """The float32 twin of ``target64`` (for the tolerance rule)."""
    return copy.deepcopy(target64).float()


@pytest.fixture(scope="module", params=["zlab", "zlab-swa"])
def dflash2_dir(request, target64, tmp_path_factory):
    """A DFlash 2 checkpoint over full layers, or a causal sliding layer (window 5) before a full one."""
    return make_dflash2(tmp_path_factory.mktemp(f"d2-{request.param}"), target64, base=request.param)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    target = make_target("qwen3", tmp_path_factory.mktemp("t16"), vocab=SMALL_VOCAB, seed=2)
    path = make_dflash2(tmp_path_factory.mktemp("d16"), target, base="zlab-swa", block_size=5, seed=3)
    return target, spec_decode.load_drafter(path, target)


def _context(drafter, target, ids):
    """The drafter's state after ``ids [1, n]`` and the tapped features ``[1, n, k H]``."""
    with torch.no_grad():
        features = drafter.features(target(ids, output_hidden_states=True).hidden_states)
    state = drafter.new_state(ids.shape[1], ids.device, drafter.fc.weight.dtype)
    drafter.append_context(state, features)
    return state, features


# -- loading ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["", ".weight"])
def test_the_published_layout_loads_every_tensor(tmp_path, target64, suffix):
    path = make_dflash2(tmp_path / "d", target64, base="zlab-swa", codebook_suffix=suffix, dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    assert not set(DFLASH2_SIZES) & set(config) and set(DFLASH2_SIZES) <= set(config["dflash_config"])
    drafter = spec_decode.load_drafter(path, target64)
    cfg = drafter.cfg
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == \
        tuple(DFLASH2_SIZES[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"))
    assert cfg.layer_windows == [DRAFTER_WINDOW, None] and cfg.layer_causal == [True, False]
    mine = drafter.state_dict()
    stored = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in
              load_file(str(path / "model.safetensors")).items()}
    assert set(stored) == set(mine)
    assert all(torch.equal(mine[k].float(), stored[k]) for k in stored)


def test_loaded_weights_equal_upstreams(upstream, dflash2_dir, target64):
    mine = spec_decode.load_drafter(dflash2_dir, target64).state_dict()
    up = upstream_drafter(upstream, dflash2_dir).state_dict()
    renamed = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in up.items()
               if not k.startswith("rotary_emb")}
    assert set(renamed) == set(mine)
    assert all(torch.equal(mine[k], renamed[k]) for k in mine)


# -- the block and the selector against upstream's modules (float64) -------------------------------

def _upstream_block(up, target, features, anchor, mask_id, block_size, upstream):
    """Upstream's final hidden states of the block ``[anchor, MASK x (B - 1)]`` after ``features``."""
    block = torch.full((1, block_size), mask_id)
    block[0, 0] = anchor
    n = features.shape[1]
    with torch.no_grad():
        hidden = up(target_hidden=features.to(up.fc.weight.dtype),
                    noise_embedding=upstream._raw_input_embeddings(target, block),
                    position_ids=torch.arange(n + block_size)[None])
    return hidden[0], block


def _forced_path(upstream, monkeypatch, up, head, hidden, logits, anchor, tokens, temperature):
    """Upstream's ``propose`` at ``temperature`` made to walk ``tokens``: its draw at each slot returns
    that token's index among its (unsorted) candidates; -> ``q [n, vocab]`` along the path."""
    _, candidates = torch.topk(logits, up.candidate_selector.top_k, dim=-1, sorted=False)   # [1, n, k]
    steps = iter(range(len(tokens)))

    def draw(q):
        i = next(steps)
        return (candidates[0, i] == tokens[i]).nonzero()[0]
    monkeypatch.setattr(upstream, "_sample_probs", draw)
    with torch.no_grad():
        path, cands, q = up.propose(hidden[None], torch.tensor([anchor]), head, temperature)
    assert path[0].tolist() == tokens
    return torch.zeros(len(tokens), logits.shape[-1], dtype=q.dtype).scatter(-1, cands[0], q[0])


def test_block_drafts_and_sampling_q_equal_upstreams_modules(upstream, dflash2_dir, target64, target32,
                                                             monkeypatch):
    """Per round: fold's final hidden states equal upstream's (float64; upstream forms RoPE angles in
    float32, so the bound is the float32 twin's), the greedy candidate path is upstream's exactly,
    and at temperature 0.8 the draft distributions along fold's sampled path are upstream's."""
    drafter = spec_decode.load_drafter(dflash2_dir, target64)
    up, up32 = upstream_drafter(upstream, dflash2_dir), upstream_drafter(upstream, dflash2_dir, torch.float32)
    cfg, head = drafter.cfg, upstream._output_head(target64)
    gen = torch.Generator().manual_seed(7)
    for n, anchor in [(6, 3), (19, 40), (12, 95)]:                     # 19 > the sliding window
        read = make_read("dflash", cfg.rope)                            # one read per sequence
        ids = torch.randint(0, 96, (1, n), generator=gen)
        state, features = _context(drafter, target64, ids)
        mine = drafter.block_hidden(state, anchor, read)
        want, block = _upstream_block(up, target64, features, anchor, cfg.mask_token_id, cfg.block_size, upstream)
        twin, _ = _upstream_block(up32, target32, features.float(), anchor, cfg.mask_token_id, cfg.block_size,
                                  upstream)
        check_close(f"block hidden n={n}", mine, want, twin, torch.float32)
        with torch.no_grad():
            logits = up.compute_logits(want[None, 1:], head)
            greedy = up.propose(want[None, 1:], block[:, 0], head, 0.0)[0]
        assert drafter.draft(state, anchor, read)[0] == greedy[0].tolist()
        tokens, probs = drafter.select(want[1:], anchor, temperature=0.8, generator=gen)
        q = _forced_path(upstream, monkeypatch, up, head, want[1:], logits, anchor, tokens, 0.8)
        check_close(f"q n={n}", probs, q, q.float(), torch.float32)
        assert torch.equal(probs > 0, q > 0)                              # mass on the top_k candidates only


# -- the loop ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", spec_decode.POLICIES)
def test_every_policy_is_lossless_batch_two(small, policy):
    """Left-padded batch of two prompts longer than the policies' windows (FOLD reads far memory)."""
    target, drafter = small
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SMALL_VOCAB - 1, (n,), generator=g) for n in (23, 14)]
    ids, mask = padded_batch(prompts)
    result = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=12, policy=policy,
                                  **OPTIONS[policy])
    for b, p in enumerate(prompts):
        assert torch.equal(result.sequences[b, :len(p) + 12], greedy_ar(target, p, 12)), (policy, b)


def test_a_tree_is_lossless_and_rescores_each_node_given_its_token(small):
    target, drafter = small
    ids = torch.randint(0, SMALL_VOCAB - 1, (1, 21), generator=torch.Generator().manual_seed(2))
    result = spec_decode.generate(target, drafter, ids, max_new_tokens=12, tree=(4, 4, 4), policy="fold", window=8)
    assert torch.equal(result.sequences[0], greedy_ar(target, ids[0], 12))
    target64 = copy.deepcopy(target).double()
    drafter64 = copy.deepcopy(drafter).double()
    drafter64.bind(target64)
    state, _ = _context(drafter64, target64, ids)
    read = make_read("dflash", drafter.cfg.rope)
    tree = drafter64.selector_tree(state, 5, read, (4, 4, 4))
    hidden = drafter64.slot_hidden(state, 5, read)
    assert tree == _tree_by_hand(drafter64, hidden, 5, (4, 4, 4))
    assert tree != _tree_by_hand(drafter64, hidden, 5, (4, 4, 4), given_parent=False)   # the parent matters here


@torch.no_grad()
def _tree_by_hand(drafter, hidden, anchor, widths, given_parent=True):
    """The selector's tree, float64: children of a node with token p at depth l are slot l's top_k
    logits' tokens c, scored ``log softmax_c(logit_c + <pred[p] * W h_l, succ[c]>)`` plus the node's
    (``given_parent=False``: p is the anchor for every node, a tree blind to the path)."""
    selector = drafter.candidate_selector
    logits = drafter.head(hidden)
    nodes, frontier = [(anchor, -1, 0, 0.0)], [0]
    for level, width in enumerate(widths):
        unary, cands = torch.topk(logits[level], selector.top_k)
        wh = hidden[level] @ selector.hidden_projection.weight.T
        scored = []
        for node in frontier:
            p = nodes[node][0] if given_parent else anchor
            pair = torch.stack([(selector.predecessor_codebook[p] * wh * selector.successor_codebook[c])
                                .sum() for c in cands])
            logq = torch.log_softmax(unary + pair, -1)
            scored += [(nodes[node][3] + float(logq[j]), node, int(cands[j])) for j in range(len(cands))]
        scored.sort(key=lambda s: (-s[0], s[1], s[2]))
        frontier = []
        for score, parent, token in scored[:width]:
            nodes.append((token, parent, nodes[parent][2] + 1, score))
            frontier.append(len(nodes) - 1)
    return [n[0] for n in nodes], [n[1] for n in nodes], [n[2] for n in nodes]


VOCAB8 = SAMPLING_VOCAB
TEMPERATURE = 1.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A vocabulary of 8 and a DFlash 2 drafter of block 3 whose selector keeps 4 candidates."""
    target = make_target("qwen3", tmp_path_factory.mktemp("t8"), vocab=VOCAB8, seed=3)
    path = make_dflash2(tmp_path_factory.mktemp("d8"), target, block_size=3, seed=4)
    return target, spec_decode.load_drafter(path, target)


@torch.no_grad()
def _target_logits(target, context, depth):
    """The target's next-token logits after ``context + prefix`` for every prefix of up to ``depth``
    tokens: ``{prefix tuple: [V]}``."""
    table = {}
    for n in range(depth + 1):
        prefixes = list(itertools.product(range(VOCAB8), repeat=n))
        tails = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), n)
        ids = torch.cat([context.repeat(len(prefixes), 1), tails], 1)
        table.update(zip(prefixes, target(ids).logits[:, -1]))
    return table


def test_a_round_of_rejection_sampling_keeps_the_targets_distribution(tiny):
    """The selector's q (4 of 8 tokens: no mass on half the vocabulary) through the loop's acceptance,
    3000 rounds from one context: the first token each commits follows the target's distribution at
    TEMPERATURE (chi-square, p = 0.001), and both acceptance and rejection occur."""
    target, drafter = tiny
    prompt, anchor = torch.tensor([1, 5, 2, 6, 3, 0, 4, 2, 5, 1, 6, 3]), 2
    state, _ = _context(drafter, target, prompt[None])
    hidden = drafter.slot_hidden(state, anchor, make_read("dflash", drafter.cfg.rope))      # [2, H]
    table = _target_logits(target, torch.cat([prompt, torch.tensor([anchor])]), hidden.shape[0])
    gen, counts, kept = torch.Generator().manual_seed(0), torch.zeros(VOCAB8, dtype=torch.float64), []
    for _ in range(3000):
        tokens, probs = drafter.select(hidden, anchor, TEMPERATURE, gen)
        rows = torch.stack([table[tuple(tokens[:i])] for i in range(len(tokens) + 1)])
        a, token = accept(tokens, probs, rows, TEMPERATURE, gen)
        counts[tokens[0] if a else token] += 1
        kept.append(a)
    assert 0 < sum(kept) and min(kept) == 0
    assert_follows(counts, torch.softmax(table[()].double() / TEMPERATURE, -1) * len(kept))


def test_sampling_through_the_loop_is_reproducible_and_accepts_some_drafts(tiny):
    target, drafter = tiny
    prompt = torch.tensor([[1, 5, 2, 6, 3, 0, 4, 2, 5, 1, 6, 3]]).repeat(12, 1)
    runs = [spec_decode.generate(target, drafter, prompt, max_new_tokens=6, temperature=TEMPERATURE, window=4,
                                 generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    per = runs[0].stats["per_sequence"]
    accepted = sum(sum(r - 1 for r in s["accepted_per_round"]) for s in per)
    assert 0 < accepted < sum(s["drafted_tokens"] for s in per)


def test_draft_len_and_cutoff_cut_the_selectors_chain(small):
    target, drafter = small
    ids = torch.randint(0, SMALL_VOCAB - 1, (1, 17), generator=torch.Generator().manual_seed(5))
    state, _ = _context(drafter, target, ids)
    read = make_read("dflash", drafter.cfg.rope)
    full, _ = drafter.draft(state, 4, read)
    assert len(full) == drafter.cfg.block_size - 1
    for n in range(1, len(full) + 1):
        assert drafter.draft(state, 4, read, max_drafts=n)[0] == full[:n]
    top = _greedy_top_probabilities(drafter, drafter.slot_hidden(state, 4, read), 4, full)
    ranked = sorted(top)
    for cutoff in [ranked[0] / 2] + [(a + b) / 2 for a, b in zip(ranked, ranked[1:])] + [(ranked[-1] + 1) / 2]:
        want = next((i for i, p in enumerate(top) if p < cutoff), len(top))
        assert drafter.draft(state, 4, read, cutoff=cutoff)[0] == full[:want], cutoff


@torch.no_grad()
def _greedy_top_probabilities(drafter, hidden, anchor, path):
    """The top probability of the selector's softmax (temperature 1) at each slot of the greedy path."""
    selector, out, prev = drafter.candidate_selector, [], anchor
    logits = drafter.head(hidden).float()
    for k, token in enumerate(path):
        unary, cands = torch.topk(logits[k], selector.top_k)
        wh = hidden[k].float() @ selector.hidden_projection.weight.float().T
        pair = selector.successor_codebook[cands].float() @ (selector.predecessor_codebook[prev].float() * wh)
        out.append(float(torch.softmax(unary + pair, -1).max()))
        prev = token
    return out


# -- kernel sizes upstream cannot run ---------------------------------------------------------------

def _conv_by_hand(x, coefficients, base, group_size):
    """``y[t] = sum_{o <= t, o < K} (base[o] + coefficients[t, o] per group) * x[t - o]``, float64 loops."""
    n, t_len, hidden = x.shape
    y = torch.zeros_like(x)
    for b, t, o, c in itertools.product(range(n), range(t_len), range(base.shape[0]), range(hidden)):
        if o <= t:
            y[b, t, c] += (base[o, c] + coefficients[b, t, o, c // group_size]) * x[b, t - o, c]
    return y


@pytest.mark.parametrize("rows, taps", [(4, 2), (4, 3), (2, 4), (1, 3), (3, 5)])
def test_the_convolution_reads_only_rows_of_its_block(rows, taps):
    """Includes blocks shorter than ``taps - 1`` (upstream's padding makes those a shape error)."""
    g = torch.Generator().manual_seed(rows * 10 + taps)
    x = torch.randn(2, rows, 8, dtype=torch.float64, generator=g)
    coefficients = torch.randn(2, rows, taps, 4, dtype=torch.float64, generator=g)
    base = torch.randn(taps, 8, dtype=torch.float64, generator=g)
    want = _conv_by_hand(x, coefficients, base, 2)      # float64 both: the rule's float64 floor
    check_close("conv", dynamic_causal_conv(x, coefficients, base, 2), want, want, torch.float64)


def _cut_taps(path, out, taps):
    """``path``'s DFlash 2 checkpoint with each convolution cut to its first ``taps`` taps."""
    out.mkdir()
    config = json.loads((path / "config.json").read_text())
    kernel = config["dflash_config"]["conv_kernel_size"]
    config["dflash_config"]["conv_kernel_size"] = taps
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(path / "model.safetensors"))
    for name in list(state):
        if name.endswith("base_kernel"):
            state[name] = state[name][:, :taps]
        elif name.endswith("kernel_projection.weight"):      # rows laid out [2, K, groups]
            w = state[name]
            state[name] = w.view(2, kernel, -1, w.shape[-1])[:, :taps].reshape(-1, w.shape[-1])
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def test_a_kernel_longer_than_the_block_reads_the_taps_inside_it(tmp_path, target64):
    """Block 2, kernel 4 (upstream's convolution fails on it): the drafts equal those of the same
    checkpoint cut to 2 taps, which the block's rows cover, and the tail="shrink" loop stays lossless
    with a kernel longer than its last, shorter blocks."""
    path = make_dflash2(tmp_path / "k4", target64, block_size=2, sizes=dict(conv_kernel_size=4))
    long, cut = (spec_decode.load_drafter(p, target64) for p in (path, _cut_taps(path, tmp_path / "k2", 2)))
    read = make_read("dflash", long.cfg.rope)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(8))
    a, b = _context(long, target64, ids)[0], _context(cut, target64, ids)[0]
    want = cut.block_hidden(b, 7, read)                 # float64 both: the rule's float64 floor
    check_close("block hidden", long.block_hidden(a, 7, read), want, want, torch.float64)
    assert long.draft(a, 7, read) == cut.draft(b, 7, read)
    path = make_dflash2(tmp_path / "k6", target64, block_size=5, sizes=dict(conv_kernel_size=6))
    drafter = spec_decode.load_drafter(path, target64)
    result = spec_decode.generate(target64, drafter, ids, max_new_tokens=7, policy="fold", window=4, tail="shrink")
    assert torch.equal(result.sequences[0], greedy_ar(target64, ids[0], 7))


def test_a_kernel_longer_than_the_block_equals_upstream_cut_to_the_block(upstream, tmp_path, target64, target32):
    path = make_dflash2(tmp_path / "k4", target64, block_size=2, sizes=dict(conv_kernel_size=4))
    drafter = spec_decode.load_drafter(path, target64)
    up = upstream_drafter(upstream, _cut_taps(path, tmp_path / "k2", 2))
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(9))
    state, features = _context(drafter, target64, ids)
    want, _ = _upstream_block(up, target64, features, 7, drafter.cfg.mask_token_id, 2, upstream)
    up32 = upstream_drafter(upstream, tmp_path / "k2", torch.float32)
    twin, _ = _upstream_block(up32, target32, features.float(), 7, drafter.cfg.mask_token_id, 2, upstream)
    check_close("kernel 4, block 2", drafter.block_hidden(state, 7, make_read("dflash", drafter.cfg.rope)), want, twin,
                torch.float32)


# -- bad checkpoints --------------------------------------------------------------------------------

DFLASH = dict(block_size=4, target_layer_ids=[0, 2], mask_token_id=96)


@pytest.mark.parametrize("sizes, error, words", [
    (dict(conv_kernel_size=None), ValueError, "a DFlash2DraftModel needs conv_kernel_size"),
    (dict(selector_top_k=None), ValueError, "a DFlash2DraftModel needs selector_top_k"),
    (dict(conv_kernel_size=0), ValueError, "dflash_config.conv_kernel_size must be an int >= 1, got 0"),
    (dict(selector_rank=2.5), TypeError, "dflash_config.selector_rank must be an int >= 1, got 2.5"),
    (dict(selector_top_k=True), TypeError, "dflash_config.selector_top_k must be an int >= 1, got True"),
    (dict(conv_group_size=24), ValueError, "conv_group_size=24 must divide hidden_size=64"),
    (dict(selector_top_k=98), ValueError, "selector_top_k=98 exceeds vocab_size=97"),
    (dict(conv_kernel_size=3), ValueError, "layers.0.attention_conv.base_kernel (2, 2, 64) (config wants (2, 3, 64))"),
    (dict(selector_rank=4), ValueError, "candidate_selector.predecessor_codebook (97, 8) (config wants (97, 4))"),
])
def test_a_bad_dflash2_checkpoint_fails_naming_the_field(tmp_path, target64, sizes, error, words):
    path = make_dflash2(tmp_path / "d", target64)
    dflash = {**DFLASH, **DFLASH2_SIZES, **sizes}
    rewrite_config(path, dflash_config={k: v for k, v in dflash.items() if v is not None})
    with pytest.raises(error) as info:
        spec_decode.load_drafter(path, target64)
    assert words in str(info.value)


def test_missing_selector_or_conv_weights_are_named(tmp_path, target64):
    path = make_dflash2(tmp_path / "d", target64)
    state = load_file(str(path / "model.safetensors"))
    del state["candidate_selector.successor_codebook"], state["layers.1.mlp_conv.kernel_projection.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        spec_decode.load_drafter(path, target64)
    assert "missing ['candidate_selector.successor_codebook', 'layers.1.mlp_conv.kernel_projection.weight']" in \
        str(info.value)
