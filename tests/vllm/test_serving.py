"""fold in vLLM's CPU build: the plug-in, the FOLD backend's reads against the reference, and the
engine's own greedy output, drafts and spec-decode metrics (tiny random pairs, engines built once)."""

import pytest
import torch

import fold.vllm
from reference.tolerance import check_close
from tests.vllm.engine import (K, LATER, MAX_TOKENS, PROMPTS, SMALL_W, configured, drafting, engine, run_recorded,
                               served, spec_metrics, truth)
from tests.vllm.pair import make_drafter


@pytest.fixture(scope="module", params=[dict(read="fold", window=SMALL_W, alpha=2.0),
                                        dict(read="rerope", window=SMALL_W, training_length=64),
                                        dict(read="window", window=SMALL_W)], ids=["fold", "rerope", "window"])
def small_window(request, pairs):
    """An engine whose drafter reads with a small window (its far memory active), two batches served."""
    def work(llm):
        return dict(block=request.param, first=run_recorded(llm, PROMPTS, MAX_TOKENS),
                    later=run_recorded(llm, LATER, [16, 16]), metrics=spec_metrics(llm))
    return served(work, pairs["plain"], configured(pairs, "drafter-" + request.param["read"], **request.param))


def test_small_window_is_lossless(small_window, target_greedy):
    """Greedy output with the far branch active equals the target's own (vLLM without speculation),
    for four concurrent requests of different lengths, then two more on freed pages."""
    assert small_window["first"][0] == target_greedy[0]
    assert small_window["later"][0] == target_greedy[1]
    assert len({t for out in target_greedy[0] for t in out}) > 20          # a target whose output varies


def test_target_greedy_equals_hf(pairs, target_greedy):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(pairs["plain"], dtype=torch.float32).eval()
    for prompt, want, m in zip(PROMPTS[:2], target_greedy[0][:2], MAX_TOKENS[:2]):
        got = model.generate(torch.tensor([prompt]), max_new_tokens=m, do_sample=False)[0, len(prompt):].tolist()
        assert got == want


def test_every_drafter_attention_output_equals_the_reference(small_window):
    """Each recorded drafter attention call (both layers, every round, both batches) against the
    float64 reference on the same cache read back densely, within PyTorch's own float32 error."""
    calls = drafting(small_window["first"][1] + small_window["later"][1])
    assert len(calls) >= 20
    assert any(min(c["seq_lens"]) - c["n_q"] > SMALL_W + K + 1 for c in calls)     # the far branch is read
    for i, call in enumerate(calls):
        check_close(f"call {i} out", call["out"], truth(call, True), truth(call, False), torch.float32)


SLIDING = 16               # the sliding drafter's window (every layer: dflash_config.use_swa)


@pytest.fixture(scope="module", params=["fold", "window"])
def sliding(request, pairs):
    """A drafter whose layers are all sliding-window layers (non-causal, MiMo-style ``use_swa``)."""
    drafter = make_drafter(pairs["root"] / "drafter-swa", config_overrides=dict(dflash_config=dict(
        block_size=4, target_layer_ids=[0, 2], mask_token_id=255, use_swa=True, swa_window_size=SLIDING)))
    block = dict(read="fold", window=SMALL_W, alpha=2.0) if request.param == "fold" else dict(read="window", window=0)
    out, calls, _, _ = served(lambda llm: run_recorded(llm, PROMPTS, MAX_TOKENS), pairs["plain"],
                              fold.vllm.configure(drafter, pairs["root"] / f"drafter-swa-{request.param}", **block),
                              blocks=128)                  # a second cache group: the sliding one
    return dict(read=request.param, out=out, calls=calls)


def test_sliding_layers_follow_the_per_layer_rules(sliding, target_greedy):
    """The paper's per-layer rule (the native window local, every older entry far memory for ``fold``;
    the native read for ``window``), each call against the reference with the layer's own window."""
    assert sliding["out"] == target_greedy[0]
    calls = drafting(sliding["calls"])
    assert len(calls) >= 20 and any(min(c["seq_lens"]) > SLIDING + K + 1 for c in calls)
    assert {c["sliding"] for c in calls} == {SLIDING}
    for i, call in enumerate(calls):
        for table in call["tables"]:     # the far memory is kept: no page freed (vLLM's null page) as out of window
            assert len(set(table)) == len(table), f"call {i}: pages {table}"
        check_close(f"call {i} out", call["out"], truth(call, True), truth(call, False), torch.float32)


def test_pages_are_reused_after_requests_end(small_window):
    first = set().union(*(c["pages"] for c in small_window["first"][1]))
    later = set().union(*(c["pages"] for c in small_window["later"][1]))
    assert later & first


@pytest.fixture(scope="module")
def stock_and_wide(pairs):
    """The stock DFlash drafter and the same drafter through fold with a window past every context."""
    runs = {}
    for name, drafter in (("stock", pairs["agreeing"]), ("wide", configured(
            pairs, "drafter-wide", drafter="agreeing", read="fold", window=4096, alpha=2.0))):
        def work(llm):
            out, calls, drafts, stock = run_recorded(llm, PROMPTS, MAX_TOKENS)
            return dict(out=out, calls=calls, drafts=drafts, stock=stock, metrics=spec_metrics(llm))
        runs[name] = served(work, pairs["pulled"], drafter)
    return runs


def test_wide_window_gives_the_stock_drafts_acceptance_and_output(stock_and_wide):
    stock, wide = stock_and_wide["stock"], stock_and_wide["wide"]
    assert not stock["calls"] and wide["calls"]                  # fold served the wide engine's drafter only
    assert len(stock["drafts"]) == len(wide["drafts"]) > 10
    for a, b in zip(stock["drafts"], wide["drafts"]):
        assert torch.equal(a, b)
    assert stock["out"] == wide["out"]
    assert stock["metrics"] == wide["metrics"]
    assert wide["metrics"]["num_accepted_tokens"] > 0


def test_wide_window_attention_equals_the_stock_read(stock_and_wide):
    """Call by call, fold's drafter outputs and the stock CPU kernel's (same inputs: the drafts agree)
    both lie within PyTorch's float32 error of the float64 reference on the cache fold read."""
    wide, stock = stock_and_wide["wide"], stock_and_wide["stock"]
    drafter_layers = {c["layer"] for c in wide["calls"]}
    stock_calls = [c for c in stock["stock"] if c["layer"] in drafter_layers]
    assert len(stock_calls) == len(wide["calls"]) > 20, ([c["out"].shape[0] for c in stock_calls],
                                                         [c["out"].shape[0] for c in wide["calls"]])
    for i, (ours, theirs) in enumerate(zip(wide["calls"], stock_calls)):
        assert ours["layer"] == theirs["layer"]
        want, twin = truth(ours, True), truth(ours, False)
        check_close(f"fold call {i}", ours["out"], want, twin, torch.float32)
        check_close(f"stock call {i}", theirs["out"], want, twin, torch.float32)


@pytest.fixture(scope="module")
def sinks(pairs):
    """A drafter with attention sinks: the stock CPU kernel takes them natively, fold merges them."""
    drafter = make_drafter(pairs["root"] / "drafter-sinks", sinks=True)
    runs = {}
    for name, path in (("stock", drafter), ("wide", fold.vllm.configure(
            drafter, pairs["root"] / "drafter-sinks-wide", read="fold", window=4096, alpha=2.0))):
        runs[name] = served(lambda llm: run_recorded(llm, PROMPTS[:2], MAX_TOKENS[:2]), pairs["plain"], path)
    return runs


def test_attention_sinks_match_the_stock_read(sinks):
    """With sinks (one more entry per head: logit s_h, value 0), fold's output and the stock kernel's
    lie within float32 error of the reference merged with the sink, call by call; drafts agree."""
    (_, wide, wide_drafts, _), (_, _, stock_drafts, stock) = sinks["wide"], sinks["stock"]
    assert all(torch.equal(a, b) for a, b in zip(wide_drafts, stock_drafts)) and len(wide_drafts) > 5
    layers = {c["layer"] for c in wide}
    stock = [c for c in stock if c["layer"] in layers]
    assert len(stock) == len(wide) > 10
    for i, (ours, theirs) in enumerate(zip(wide, stock)):
        want, twin = truth(ours, True), truth(ours, False)
        check_close(f"fold call {i}", ours["out"], want, twin, torch.float32)
        check_close(f"stock call {i}", theirs["out"], want, twin, torch.float32)


def test_spec_metrics_count_the_recorded_drafts(stock_and_wide):
    """vLLM's own counters against the drafts seen: one draft of K tokens per request per round, less
    the draft each request proposes in its last step, which is never verified."""
    wide = stock_and_wide["wide"]
    rows = sum(d.shape[0] for d in wide["drafts"])
    assert wide["metrics"]["num_drafts"] == rows - len(PROMPTS)
    assert wide["metrics"]["num_draft_tokens"] == (rows - len(PROMPTS)) * K
    assert sum(wide["metrics"]["num_accepted_tokens_per_pos"]) == wide["metrics"]["num_accepted_tokens"]


@pytest.mark.parametrize("block, words", [
    (dict(read="fold", window=-1), "fold.window must be an integer >= 0"),
    (dict(read="fold", window=8, alpha=0.5), "fold.alpha must be a number in [1, 10000]"),
    (dict(read="folded", window=8), "fold.read must be one of"),
    (dict(read="window", window=8, alpha=2.0), "fold.alpha is not a field of read='window'"),
])
def test_a_bad_block_stops_the_engine_at_start(pairs, block, words):
    import json

    path = pairs["root"] / "drafter-bad"
    path.mkdir(exist_ok=True)
    for item in pairs["drafter"].iterdir():
        if item.name != "config.json" and not (path / item.name).exists():
            (path / item.name).symlink_to(item)
    config = json.loads((pairs["drafter"] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, fold=block)))
    with pytest.raises(ValueError) as info:
        engine(pairs["plain"], path)
    assert words in str(info.value)
