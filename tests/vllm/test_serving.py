"""fold in vLLM's CPU build: the plug-in, the FOLD backend's reads against the reference, and the
engine's own greedy output, drafts and spec-decode metrics (tiny random pairs, engines built once)."""

import gc
import inspect

import pytest
import torch

import fold.vllm
from fold.vllm import compat
from fold.vllm.backend import FoldAttentionImpl, cache_pages
from reference import fold_attention_ref
from reference.tolerance import check_close
from tests.vllm.pair import HEAD_DIM, make_drafter, make_target

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

K = 3                      # num_speculative_tokens: blocks of n_q = 4 rows
SMALL_W = 8                # far memory active from the first round
PROMPTS = [list(range(3, 60)), [5 + (7 * i) % 200 for i in range(150)], list(range(9, 30)),
           [3 + (11 * i) % 240 for i in range(230)]]
MAX_TOKENS = [40, 24, 32, 12]                       # unequal: requests finish while others continue
LATER = [[4 + (13 * i) % 230 for i in range(190)], list(range(20, 90))]   # a second batch on freed pages


def _engine(target, drafter=None, blocks=48):
    """An engine with a small cache (``blocks`` pages of 32 entries), so freed pages get reused."""
    spec = None if drafter is None else {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K}
    return LLM(model=str(target), dtype="float32", max_model_len=1024, enforce_eager=True, skip_tokenizer_init=True,
               seed=0, speculative_config=spec, disable_log_stats=False, block_size=32,
               num_gpu_blocks_override=blocks)


def _generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_metrics(llm):
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", getattr(m, "values", None))
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


class Recorder:
    """Wraps a class method for the duration of a ``with`` block, keeping what each call saw."""

    def __init__(self, cls, name, keep):
        self.cls, self.name, self.keep, self.calls = cls, name, keep, []

    def __enter__(self):
        self.original = getattr(self.cls, self.name)
        original, keep, calls = self.original, self.keep, self.calls

        def wrapped(obj, *args, **kwargs):
            result = original(obj, *args, **kwargs)
            calls.append(keep(obj, args, kwargs, result))
            return result

        setattr(self.cls, self.name, wrapped)
        return self

    def __exit__(self, *exc):
        setattr(self.cls, self.name, self.original)


FORWARD = inspect.signature(FoldAttentionImpl.forward)
STOCK_FORWARD = inspect.signature(compat.CPUAttentionBackendImpl.forward)


def _keep_attention(impl, args, kwargs, output):
    """The query, the cache read back densely per sequence (NaN beyond its length), the output."""
    bound = FORWARD.bind(impl, *args, **kwargs).arguments
    query, kv_cache, meta = bound["query"], bound["kv_cache"], bound["attn_metadata"]
    if meta is None:
        return None
    tokens = meta.num_actual_tokens
    k_pages, v_pages = cache_pages(kv_cache, impl.head_size)
    seq_lens = meta.seq_lens.tolist()
    page = k_pages.shape[1]
    dense = torch.full((2, meta.num_reqs, max(seq_lens), k_pages.shape[2], impl.head_size), float("nan"))
    for b, length in enumerate(seq_lens):
        j = torch.arange(length)
        pages = meta.block_table[b, j // page].long()
        dense[0, b, :length], dense[1, b, :length] = k_pages[pages, j % page], v_pages[pages, j % page]
    tables = [meta.block_table[b, :-(-length // page)].tolist() for b, length in enumerate(seq_lens)]
    used = {p for table in tables for p in table}
    return dict(layer=bound["layer"].layer_name, read=impl.read, rope=impl.rope, sinks=impl.sinks, scale=impl.scale, uniform=meta.uniform, n_q=meta.max_query_len,
                q=query[:tokens].clone(), k=dense[0], v=dense[1], seq_lens=seq_lens, pages=used, tables=tables,
                out=output[:tokens].clone())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    plain, pulled = make_target(root / "target"), make_target(root / "target-pulled", pull=4.0)
    # a drafter whose layers shape its drafts, and a weaker one whose drafts the pulled target accepts at times
    drafter, agreeing = make_drafter(root / "drafter"), make_drafter(root / "drafter-agreeing", scale=0.02)
    return dict(root=root, plain=plain, pulled=pulled, drafter=drafter, agreeing=agreeing)


def _configured(pairs, name, drafter="drafter", **block):
    return fold.vllm.configure(pairs[drafter], pairs["root"] / name, **block)


@pytest.fixture(scope="module")
def target_greedy(pairs):
    llm = _engine(pairs["plain"])
    result = _generate(llm, PROMPTS, MAX_TOKENS), _generate(llm, LATER, [16, 16])
    del llm
    gc.collect()
    return result


def _keep_stock(impl, args, kwargs, output):
    bound = STOCK_FORWARD.bind(impl, *args, **kwargs).arguments
    meta = bound["attn_metadata"]
    if meta is None:
        return None
    return dict(layer=bound["layer"].layer_name, out=output[:meta.num_actual_tokens].clone())


def _run_recorded(llm, prompts, max_tokens):
    with Recorder(FoldAttentionImpl, "forward", _keep_attention) as rec, \
            Recorder(compat.CPUAttentionBackendImpl, "forward", _keep_stock) as stock, \
            Recorder(compat.DFlashProposer, "propose", lambda obj, a, kw, r: r.clone()) as drafts:
        out = _generate(llm, prompts, max_tokens)
    return out, [c for c in rec.calls if c is not None], drafts.calls, [c for c in stock.calls if c is not None]


@pytest.fixture(scope="module", params=[dict(read="fold", window=SMALL_W, alpha=2.0),
                                        dict(read="rerope", window=SMALL_W, training_length=64),
                                        dict(read="window", window=SMALL_W)], ids=["fold", "rerope", "window"])
def small_window(request, pairs):
    """An engine whose drafter reads with a small window (its far memory active), two batches served."""
    llm = _engine(pairs["plain"], _configured(pairs, "drafter-" + request.param["read"], **request.param))
    first = _run_recorded(llm, PROMPTS, MAX_TOKENS)
    later = _run_recorded(llm, LATER, [16, 16])
    metrics = _spec_metrics(llm)
    del llm
    gc.collect()
    return dict(block=request.param, first=first, later=later, metrics=metrics)


def test_small_window_is_lossless(small_window, target_greedy):
    """Greedy output with the far branch active equals the target's own (vLLM without speculation),
    for four concurrent requests of different lengths, then two more on freed pages."""
    assert small_window["first"][0] == target_greedy[0]
    assert small_window["later"][0] == target_greedy[1]


def test_target_greedy_equals_hf(pairs, target_greedy):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(pairs["plain"], dtype=torch.float32).eval()
    for prompt, want, m in zip(PROMPTS[:2], target_greedy[0][:2], MAX_TOKENS[:2]):
        got = model.generate(torch.tensor([prompt]), max_new_tokens=m, do_sample=False)[0, len(prompt):].tolist()
        assert got == want


def _window_truth(call, upcast):
    """FOLD's window alone, densely: row r sees j > n + r - D, queries and keys rotated as stored."""
    dtype = torch.float64 if upcast else torch.float32
    outs = []
    n_q, group = call["n_q"], call["q"].shape[1] // call["k"].shape[2]
    q = call["q"].view(-1, n_q, *call["q"].shape[1:])
    for b, length in enumerate(call["seq_lens"]):
        n, d_pos = length - n_q, call["read"].window + n_q
        k = call["k"][b, :length].to(dtype).repeat_interleave(group, 1)
        v = call["v"][b, :length].to(dtype).repeat_interleave(group, 1)
        s = torch.einsum("rhd,jhd->hrj", q[b].to(dtype), k) * call["scale"]
        j, r = torch.arange(length), torch.arange(n_q)
        s = s.masked_fill(~(j[None, :] > (n + r - d_pos)[:, None]), float("-inf"))
        outs.append(torch.einsum("hrj,jhd->rhd", torch.softmax(s, -1), v))
    return torch.cat(outs)


def _fold_truth(call, upcast):
    read, n_q = call["read"], call["n_q"]
    q = call["q"].view(-1, n_q, *call["q"].shape[1:])
    if read.read == "rerope":
        p = torch.tensor(call["seq_lens"], dtype=torch.float64)[:, None] - n_q + torch.arange(n_q)
        q = q * (torch.log(p + 1) / torch.log(torch.tensor(float(read.training_length)))).clamp(min=1)[..., None, None]
        q = q.to(call["q"].dtype)
    out, _ = fold_attention_ref(
        q, torch.nan_to_num(call["k"]), torch.nan_to_num(call["v"]), window=read.window, rope=call["rope"],
        alpha=read.alpha if read.read == "fold" else 1.0, cache_seqlens=call["seq_lens"], keys_rotated=True,
        queries_rotated=True, softmax_scale=call["scale"], upcast=upcast, **(
            {} if read.read == "fold" else {"far_position": "fixed_distance"}))
    return out.flatten(0, 1)


def test_every_drafter_attention_output_equals_the_reference(small_window):
    """Each recorded drafter attention call (both layers, every round, both batches) against the
    float64 reference on the same cache read back densely, within PyTorch's own float32 error."""
    calls = small_window["first"][1] + small_window["later"][1]
    drafting = [c for c in calls if c["uniform"] and c["n_q"] == K + 1]
    assert len(drafting) >= 20
    assert any(min(c["seq_lens"]) - c["n_q"] > SMALL_W + K + 1 for c in drafting)     # the far branch is read
    truth = _window_truth if small_window["block"]["read"] == "window" else _fold_truth
    for i, call in enumerate(drafting):
        check_close(f"call {i} out", call["out"], truth(call, True), truth(call, False), torch.float32)


SLIDING = 16               # the sliding drafter's window (every layer: dflash_config.use_swa)


@pytest.fixture(scope="module", params=["fold", "window"])
def sliding(request, pairs):
    """A drafter whose layers are all sliding-window layers (non-causal, MiMo-style ``use_swa``)."""
    drafter = make_drafter(pairs["root"] / "drafter-swa", config_overrides=dict(dflash_config=dict(
        block_size=4, target_layer_ids=[0, 2], mask_token_id=255, use_swa=True, swa_window_size=SLIDING)))
    block = dict(read="fold", window=SMALL_W, alpha=2.0) if request.param == "fold" else dict(read="window", window=0)
    llm = _engine(pairs["plain"], fold.vllm.configure(drafter, pairs["root"] / f"drafter-swa-{request.param}",
                                                       **block), blocks=128)  # a second cache group: the sliding one
    out, calls, _, _ = _run_recorded(llm, PROMPTS, MAX_TOKENS)
    del llm
    gc.collect()
    return dict(read=request.param, out=out, calls=calls)


def _sliding_truth(call, upcast):
    """fold.spec's sliding-layer rule on the same cache, un-rotated densely, one sequence at a time."""
    from fold.spec import policies
    from reference import apply_rope

    dtype = torch.float64 if upcast else torch.float32
    rope, n_q = call["rope"], call["n_q"]
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    q = call["q"].view(-1, n_q, *call["q"].shape[1:])
    outs = []
    for b, length in enumerate(call["seq_lens"]):
        j = torch.arange(length)
        k = apply_rope(call["k"][b, :length].to(dtype), j[:, None], rope.inv_freq, inverse=True, **rot)[None]
        qb = apply_rope(q[b].to(dtype), j[-n_q:, None], rope.inv_freq, inverse=True, **rot)[None]
        v = call["v"][b, :length].to(dtype)[None]
        kw = dict(rope=rope, sliding_window=SLIDING, causal=False)
        if call["read"].read == "window":
            outs.append(policies.sliding_state(qb, k, v, **kw)[0][0])
        else:
            outs.append(policies.fold_sliding_read(qb, k, v, **kw, window=SMALL_W, alpha=2.0, backend="torch")[0])
    return torch.cat(outs)


def test_sliding_layers_follow_the_per_layer_rules(sliding, target_greedy):
    assert sliding["out"] == target_greedy[0]
    drafting = [c for c in sliding["calls"] if c["uniform"] and c["n_q"] == K + 1]
    assert len(drafting) >= 20 and any(min(c["seq_lens"]) > SLIDING + K + 1 for c in drafting)
    for i, call in enumerate(drafting):
        for table in call["tables"]:     # the far memory is kept: no page freed (vLLM's null page) as out of window
            assert len(set(table)) == len(table), f"call {i}: pages {table}"
        check_close(f"call {i} out", call["out"], _sliding_truth(call, True), _sliding_truth(call, False),
                    torch.float32)


def test_pages_are_reused_after_requests_end(small_window):
    first = set().union(*(c["pages"] for c in small_window["first"][1]))
    later = set().union(*(c["pages"] for c in small_window["later"][1]))
    assert later & first


@pytest.fixture(scope="module")
def stock_and_wide(pairs):
    """The stock DFlash drafter and the same drafter through fold with a window past every context."""
    runs = {}
    for name, drafter in (("stock", pairs["agreeing"]), ("wide", _configured(
            pairs, "drafter-wide", drafter="agreeing", read="fold", window=4096, alpha=2.0))):
        llm = _engine(pairs["pulled"], drafter)
        out, calls, drafts, stock = _run_recorded(llm, PROMPTS, MAX_TOKENS)
        runs[name] = dict(out=out, calls=calls, drafts=drafts, stock=stock, metrics=_spec_metrics(llm))
        del llm
        gc.collect()
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
        truth, twin = _fold_truth(ours, True), _fold_truth(ours, False)
        check_close(f"fold call {i}", ours["out"], truth, twin, torch.float32)
        check_close(f"stock call {i}", theirs["out"], truth, twin, torch.float32)


@pytest.fixture(scope="module")
def sinks(pairs):
    """A drafter with attention sinks: the stock CPU kernel takes them natively, fold merges them."""
    drafter = make_drafter(pairs["root"] / "drafter-sinks", sinks=True)
    runs = {}
    for name, path in (("stock", drafter), ("wide", fold.vllm.configure(
            drafter, pairs["root"] / "drafter-sinks-wide", read="fold", window=4096, alpha=2.0))):
        llm = _engine(pairs["plain"], path)
        runs[name] = _run_recorded(llm, PROMPTS[:2], MAX_TOKENS[:2])
        del llm
        gc.collect()
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
        truth, twin = (_with_sink(ours, upcast) for upcast in (True, False))
        check_close(f"fold call {i}", ours["out"], truth, twin, torch.float32)
        check_close(f"stock call {i}", theirs["out"], truth, twin, torch.float32)


def _with_sink(call, upcast):
    read, n_q = call["read"], call["n_q"]
    out, lse = fold_attention_ref(
        call["q"].view(-1, n_q, *call["q"].shape[1:]), torch.nan_to_num(call["k"]), torch.nan_to_num(call["v"]),
        window=read.window, rope=call["rope"], alpha=read.alpha, cache_seqlens=call["seq_lens"], keys_rotated=True,
        queries_rotated=True, softmax_scale=call["scale"], upcast=upcast)
    sink = call["sinks"].to(lse.dtype)
    return (out * torch.exp(lse - torch.logaddexp(lse, sink))[..., None]).flatten(0, 1)


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
    with pytest.raises(Exception) as info:
        _engine(pairs["plain"], path)
    assert words in str(info.value) or words in repr(info.value.__cause__)
    gc.collect()
