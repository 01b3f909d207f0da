"""Every configuration the tuner may pick, checked against the reference (``python -m tools.verify_configs``).

Each config is run on a varlen batch with NaN padding through ``fold.attention`` (both key layouts)
and, optionally, ``fold.tree_attention`` (its cached read uses the same stage-1/2 kernels), and
compared with the float64 reference under ``reference.tolerance``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from benchmarks.workloads import DrafterShape, make_inputs
import fold
from fold.config_lookup import use_config
from fold.kernels.fold_attention import FoldConfig, config_space
from fold.spec_decode.tree import tree_mask
from reference import fold_attention_ref, tree_attention_ref
from reference.tolerance import check_close


def make_case(*, n_q=10, group=4, heads_kv=2, head_dim=128, lengths=(3000, 1234), window=64, alpha=2.0,
              dtype=torch.bfloat16, keys_rotated=False, device="cpu", seed=0):
    """A varlen batch with NaN padding, in ``dtype`` on ``device``; returns (inputs, kwargs). The
    inputs are the benchmarks' (:func:`benchmarks.workloads.make_inputs`); odd seeds use partial RoPE."""
    shape = DrafterShape("verify", n_q=n_q, heads_q=heads_kv * group, heads_kv=heads_kv, head_dim=head_dim,
                         window=window, rope_theta=10000.0, rotary_dim=head_dim // 2 if seed % 2 else head_dim)
    x = make_inputs(shape, max(lengths), batch=len(lengths), dtype=dtype, device=device, keys_rotated=keys_rotated,
                    alpha=alpha, seed=seed)
    k, v = _nan_padded(x["k"], lengths), _nan_padded(x["v"], lengths)
    kwargs = dict(window=window, rope=x["rope"], alpha=alpha, keys_rotated=keys_rotated,
                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device))
    return (x["q"], k, v), kwargs


def _nan_padded(cache, lengths):
    # entries past each sequence's length are NaN: a kernel that reads one spoils its output
    for b, length in enumerate(lengths):
        cache[b, length:] = float("nan")
    return cache


def expected(case):
    """(truth in float64, the same math in the case's dtype) for out and lse, computed on the CPU."""
    (q, k, v), kwargs = case
    kwargs = {**kwargs, "cache_seqlens": kwargs["cache_seqlens"].cpu()}
    return (fold_attention_ref(q.cpu(), k.cpu(), v.cpu(), **kwargs),
            fold_attention_ref(q.cpu(), k.cpu(), v.cpu(), upcast=False, **kwargs))


def check_config(config: FoldConfig, case, want=None) -> None:
    """Raise AssertionError if ``config`` gives a wrong output or LSE on ``case``."""
    (q, k, v), kwargs = case
    (out64, lse64), (out_lp, lse_lp) = want or expected(case)
    with use_config(config):
        out, lse = fold.attention(q, k, v, **kwargs, return_lse=True, backend="triton")
    check_close(f"{config} out", out, out64, out_lp, q.dtype)
    check_close(f"{config} lse", lse, lse64, lse_lp, q.dtype)


def make_tree_case(*, n_tree=16, group=4, heads_kv=2, head_dim=128, lengths=(3000, 1234), dtype=torch.bfloat16,
                   device="cpu", seed=0):
    """A random tree per sequence over a varlen cache with NaN padding: ``(tensors, seqlens)`` with
    tensors ``(q, k_cache, v_cache, k_tree, v_tree, tree_mask)`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    batch, max_len = len(lengths), max(lengths)
    heads_q = heads_kv * group
    q = torch.randn(batch, n_tree, heads_q, head_dim, generator=g)
    kc, vc = (torch.randn(batch, max_len, heads_kv, head_dim, generator=g) for _ in range(2))
    kt, vt = (torch.randn(batch, n_tree, heads_kv, head_dim, generator=g) for _ in range(2))
    kc, vc = _nan_padded(kc, lengths), _nan_padded(vc, lengths)
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n_tree)] for _ in range(batch)]
    mask = torch.stack([tree_mask(p) for p in parents])
    tensors = tuple(x.to(device, dtype) for x in (q, kc, vc, kt, vt)) + (mask.to(device),)
    return tensors, torch.tensor(lengths, dtype=torch.int32, device=device)


def expected_tree(case):
    (q, kc, vc, kt, vt, mask), seqlens = case
    args = [x.cpu() for x in (q, kc, vc, kt, vt, mask)]
    return (tree_attention_ref(*args, cache_seqlens=seqlens.cpu()),
            tree_attention_ref(*args, cache_seqlens=seqlens.cpu(), upcast=False))


def check_tree_config(config: FoldConfig, case, want=None) -> None:
    """Raise AssertionError if ``fold.tree_attention``'s cached read with ``config`` is wrong on ``case``."""
    (q, kc, vc, kt, vt, mask), seqlens = case
    (out64, lse64), (out_lp, lse_lp) = want or expected_tree(case)
    with use_config(config):
        out, lse = fold.tree_attention(q, kc, vc, kt, vt, mask, cache_seqlens=seqlens, return_lse=True,
                                       backend="triton")
    check_close(f"{config} tree out", out, out64, out_lp, q.dtype)
    check_close(f"{config} tree lse", lse, lse64, lse_lp, q.dtype)


def verify(configs: Sequence[FoldConfig] | None = None, *, dtypes=("bfloat16", "float16"), device="cpu",
           sample: int | None = None, seed: int = 0, budget_s: float | None = None, tree: bool = False, log=print,
           **case_args):
    """Check ``configs`` (default: the whole kept space, in a seeded random order so a time budget
    still covers every kind of tile) in each dtype with unrotated keys, once more with rotated keys,
    and with ``tree`` through ``fold.tree_attention`` in the first dtype. Returns ``(checked, failures)``."""
    rows = case_args.get("n_q", 10) * case_args.get("group", 4)
    configs = list(configs or config_space(rows, case_args.get("head_dim", 128)))
    random.Random(seed).shuffle(configs)
    if sample is not None:
        configs = configs[:sample]
    cases = {(dt, rot): make_case(dtype=getattr(torch, dt), keys_rotated=rot, device=device, seed=seed, **case_args)
             for dt in dtypes for rot in (False, True)}
    wants = {key: expected(case) for key, case in cases.items()}
    tree_keys = ("group", "heads_kv", "head_dim", "lengths")
    tree_case = make_tree_case(dtype=getattr(torch, dtypes[0]), device=device, seed=seed,
                               **{k: v for k, v in case_args.items() if k in tree_keys}) if tree else None
    tree_want = expected_tree(tree_case) if tree else None
    start, checked, failures = time.monotonic(), 0, []
    for config in configs:
        checks = [(dt, False) for dt in dtypes] + [(dtypes[0], True)] + ([("tree", None)] if tree else [])
        for dt, rot in checks:
            if budget_s is not None and time.monotonic() - start > budget_s:
                log(f"verify: time budget of {budget_s:.0f} s spent after {checked} checks")
                return checked, failures
            try:
                if dt == "tree":
                    check_tree_config(config, tree_case, tree_want)
                else:
                    check_config(config, cases[dt, rot], wants[dt, rot])
            except AssertionError as exc:
                failures.append(f"{dt} keys_rotated={rot}: {exc}")
                log(f"FAIL {failures[-1]}")
            checked += 1
    return checked, failures


def main(argv=None) -> int:
    """``python -m tools.verify_configs``: 1 if any config fails, 2 on a CPU without the interpreter."""
    import argparse
    import os

    from fold.argtypes import positive

    p = argparse.ArgumentParser(prog="python -m tools.verify_configs", description=__doc__)
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=("bfloat16", "float16", "float32"))
    p.add_argument("--sample", type=positive(int), default=None, help="check this many random configs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=positive(float), default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: set TRITON_INTERPRET=1 to verify in Triton's interpreter (slow; use --sample)")
        return 2
    checked, failures = verify(dtypes=tuple(args.dtype), device=device, sample=args.sample, seed=args.seed,
                               budget_s=args.budget_s)
    print(f"verify: {checked} checks, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
