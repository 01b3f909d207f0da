"""Benchmarks of one FOLD read per provider (pytest-benchmark; not part of the test suite).

    python -m pytest tuning/bench_attention.py --benchmark-enable                       # CPU lengths
    python -m pytest tuning/bench_attention.py --benchmark-enable --benchmark-json=b.json
    FOLD_BENCH_LENGTHS=8192,32768,131072,262144 python -m pytest tuning/bench_attention.py --benchmark-enable

Every provider reads the same inputs from one setup (``tuning.workloads.make_inputs``); results are
tagged with the device and versions. Compare ratios within one run; absolute CPU times say little.
"""

import os

import pytest
import torch
import triton

import fold
from tuning.workloads import DRAFTERS, PROVIDERS, flash_available, make_inputs

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
LENGTHS = [int(x) for x in os.environ.get("FOLD_BENCH_LENGTHS", "4096,32768,131072").split(",")]
SHAPE = DRAFTERS[os.environ.get("FOLD_BENCH_DRAFTER", "llama3.1-8b")]

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


@pytest.mark.parametrize("keys_rotated", [False, True], ids=["unrotated", "rotated"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_read(benchmark, provider, length, keys_rotated):
    reason = _skip_reason(provider, length)
    if reason:
        pytest.skip(reason)
    if keys_rotated and not provider.startswith("fold"):
        pytest.skip("the layout only changes fold's read")
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
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, TREE_NODES)]
    mask = torch.zeros(TREE_NODES, TREE_NODES, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
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
    fn = TREE_PROVIDERS[provider](_tree_setup(length))
    sync = torch.cuda.synchronize if ON_GPU else (lambda: None)
    benchmark.group = f"tree {TREE_NODES} nodes L={length}"
    benchmark.extra_info.update(provider=provider, length=length, nodes=TREE_NODES, dtype=str(DTYPE),
                                device=torch.cuda.get_device_name() if ON_GPU else "cpu")
    benchmark.pedantic(lambda: (fn(), sync()), rounds=7 if ON_GPU else 5, warmup_rounds=2, iterations=1)
