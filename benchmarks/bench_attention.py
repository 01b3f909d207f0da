"""Benchmarks of one FOLD read per provider (pytest-benchmark; not part of the test suite).

    python -m pytest benchmarks/bench_attention.py --benchmark-enable                       # CPU lengths
    python -m pytest benchmarks/bench_attention.py --benchmark-enable --benchmark-json=b.json
    FOLD_BENCH_LENGTHS=8192,32768,131072,262144 python -m pytest benchmarks/bench_attention.py --benchmark-enable

Every provider reads the same inputs from one setup (``benchmarks.workloads.make_inputs``); results are
tagged with the device and versions. Compare ratios within one run; absolute CPU times say little.
Before a provider is timed its output is checked against the float64 reference of what it computes
(``reference.tolerance``: within twice PyTorch's own error in the dtype), at lengths up to CHECK_LEN.
"""

import os

import pytest
import torch
import triton

from benchmarks.workloads import DRAFTERS, PROVIDERS, flash_available, make_inputs
import fold
from fold.spec_decode.tree import tree_mask
from reference import fold_attention_ref, rope_attention_ref, tree_attention_ref
from reference.tolerance import check_close

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
LENGTHS = [int(x) for x in os.environ.get("FOLD_BENCH_LENGTHS", "4096,32768,131072").split(",")]
SHAPE = DRAFTERS[os.environ.get("FOLD_BENCH_DRAFTER", "llama3.1-8b")]
CHECK_LEN = 8192            # the float64 reference materialises all logits: longer reads are checked at this length

_inputs_cache: dict = {}


def _setup(length: int, keys_rotated: bool) -> dict:
    key = (length, keys_rotated)
    if key not in _inputs_cache:
        _inputs_cache.clear()                   # one length at a time: 128K float32 is 1 GiB
        _inputs_cache[key] = make_inputs(SHAPE, length, dtype=DTYPE, device=DEVICE, keys_rotated=keys_rotated)
    return _inputs_cache[key]


def _skip_reason(provider: str, length: int) -> str | None:
    if provider == "fold_triton" and not ON_GPU:
        return "the interpreter's timings mean nothing"
    if provider.startswith("torch_flash") and not ON_GPU:
        return "torch's CUDA flash kernel needs a GPU"
    if provider.startswith("flash") and not flash_available():
        return "flash-attn is not importable on a GPU here"
    if provider == "reference" and length > 8192:
        return "the dense reference materialises all logits"
    return None


_checked: set = set()


def _unpack_gqa(x, heads_q):
    # [B, Hkv, n_q * group, d] (workloads._pack_gqa) -> [B, n_q, Hq, d]
    batch, heads_kv, rows, head_dim = x.shape
    return x.view(batch, heads_kv, rows * heads_kv // heads_q, heads_q // heads_kv, head_dim).transpose(1, 2) \
        .reshape(batch, rows * heads_kv // heads_q, heads_q, head_dim)


def _check_provider(provider: str, length: int, keys_rotated: bool) -> None:
    """The provider's output against the float64 reference of what it computes, once per length class:
    FOLD for fold's reads, the plain read of the rotated cache for the full-read baselines, FOLD's
    first row for the paper's layout (its shared far boundary is exact for row 0 only)."""
    length = min(length, CHECK_LEN)
    if (provider, length, keys_rotated) in _checked:
        return
    x = make_inputs(SHAPE, length, dtype=DTYPE, device=DEVICE, keys_rotated=keys_rotated)
    out = PROVIDERS[provider](x)()
    out = out[0] if provider == "reference" else out             # the reference returns (out, lse)
    if provider.startswith("fold") or provider == "reference":
        args, kwargs = (x["q"], x["k"], x["v"]), dict(window=x["window"], rope=x["rope"], alpha=x["alpha"],
                                                      keys_rotated=keys_rotated)
        truth, same_dtype = (fold_attention_ref(*args, **kwargs, upcast=u)[0] for u in (True, False))
    elif "paper_layout" in provider:
        args, kwargs = (x["q"], x["k_side"], x["v"]), dict(window=x["window"], rope=x["rope"], alpha=x["alpha"])
        truth, same_dtype = (fold_attention_ref(*args, **kwargs, upcast=u)[0][:, :1] for u in (True, False))
        out = (_unpack_gqa(out, SHAPE.heads_q) if provider.startswith("torch_flash") else out)[:, :1]
    else:                                         # one plain read of the rotated cache by rotated queries
        args = (x["q_rot"], x["k_rot"], x["v"])
        kwargs = dict(rope=x["rope"], keys_rotated=True, queries_rotated=True)
        truth, same_dtype = (rope_attention_ref(*args, **kwargs, upcast=u)[0] for u in (True, False))
        if provider in ("sdpa_packed", "torch_flash_full"):
            out = _unpack_gqa(out, SHAPE.heads_q)
        elif provider == "sdpa_full":
            out = out.transpose(1, 2)
    check_close(f"{provider} L={length}", out, truth, same_dtype, DTYPE)
    _checked.add((provider, length, keys_rotated))


@pytest.mark.parametrize("keys_rotated", [False, True], ids=["unrotated", "rotated"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_read(benchmark, provider, length, keys_rotated):
    reason = _skip_reason(provider, length)
    if reason:
        pytest.skip(reason)
    if keys_rotated and not provider.startswith("fold"):
        pytest.skip("the layout only changes fold's read")
    _check_provider(provider, length, keys_rotated)
    fn = PROVIDERS[provider](_setup(length, keys_rotated))
    sync = torch.cuda.synchronize if ON_GPU else (lambda: None)

    def run():
        fn()
        sync()

    benchmark.group = f"{SHAPE.name} L={length}"
    benchmark.extra_info.update(
        provider=provider, length=length, keys_rotated=keys_rotated, dtype=str(DTYPE), drafter=SHAPE.name,
        device=torch.cuda.get_device_name() if ON_GPU else "cpu", threads=torch.get_num_threads(),
        fold=fold.__version__, torch=torch.__version__, triton=triton.__version__,
    )
    benchmark.pedantic(run, rounds=7 if ON_GPU else 5, warmup_rounds=2, iterations=1)


TREE_NODES = int(os.environ.get("FOLD_BENCH_TREE_NODES", "64"))


def _tree_setup(length: int) -> dict:
    """LongSpec-shaped inputs: a rotated cache of ``length`` entries and a random tree of TREE_NODES."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = SHAPE.heads_q, SHAPE.heads_kv, SHAPE.head_dim
    mask = tree_mask([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, TREE_NODES)])
    t = lambda *s: torch.randn(*s, generator=g).to(DEVICE, DTYPE)  # noqa: E731
    return dict(q=t(1, TREE_NODES, hq, d), k_cache=t(1, length, hkv, d), v_cache=t(1, length, hkv, d),
                k_tree=t(1, TREE_NODES, hkv, d), v_tree=t(1, TREE_NODES, hkv, d), tree_mask=mask[None].to(DEVICE))


def _dense_masked_sdpa(x):
    """The plain alternative: one SDPA over [cache ; tree] with an explicit boolean mask."""
    keys = torch.cat([x["k_cache"], x["k_tree"]], 1).transpose(1, 2)
    values = torch.cat([x["v_cache"], x["v_tree"]], 1).transpose(1, 2)
    length = x["k_cache"].shape[1]
    mask = torch.cat([torch.ones(TREE_NODES, length, dtype=torch.bool, device=keys.device), x["tree_mask"][0]], 1)
    q = x["q"].transpose(1, 2)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


TREE_PROVIDERS = {
    "fold_tree_torch": lambda x: lambda: fold.tree_attention(**x, backend="torch"),
    "fold_tree_triton": lambda x: lambda: fold.tree_attention(**x, backend="triton"),
    "dense_masked_sdpa": _dense_masked_sdpa,
}


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("provider", list(TREE_PROVIDERS))
def test_tree_read(benchmark, provider, length):
    if provider == "fold_tree_triton" and not ON_GPU:
        pytest.skip("the interpreter's timings mean nothing")
    check = _tree_setup(min(length, CHECK_LEN))            # the provider against the float64 reference first
    out = TREE_PROVIDERS[provider](check)()
    out = out.transpose(1, 2) if provider == "dense_masked_sdpa" else out
    truth, same_dtype = (tree_attention_ref(**check, upcast=u)[0] for u in (True, False))
    check_close(f"{provider} L={min(length, CHECK_LEN)}", out, truth, same_dtype, DTYPE)
    fn = TREE_PROVIDERS[provider](_tree_setup(length))
    sync = torch.cuda.synchronize if ON_GPU else (lambda: None)
    benchmark.group = f"tree {TREE_NODES} nodes L={length}"
    benchmark.extra_info.update(provider=provider, length=length, nodes=TREE_NODES, dtype=str(DTYPE),
                                device=torch.cuda.get_device_name() if ON_GPU else "cpu")
    benchmark.pedantic(lambda: (fn(), sync()), rounds=7 if ON_GPU else 5, warmup_rounds=2, iterations=1)
