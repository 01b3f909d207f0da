"""Every configuration the tuner may pick, checked against the reference (``python -m tuning verify``)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

import fold
from fold.config_lookup import use_config
from fold.kernels.fold_attention import FoldConfig, config_space
from reference import apply_rope, fold_attention_ref
from reference.tolerance import check_close


def make_case(*, n_q=10, group=4, heads_kv=2, head_dim=128, lengths=(3000, 1234), window=64, alpha=2.0,
              dtype=torch.bfloat16, keys_rotated=False, device="cpu", seed=0):
    """A varlen batch with NaN padding, in ``dtype`` on ``device``; returns (inputs, kwargs)."""
    g = torch.Generator().manual_seed(seed)
    batch, max_len = len(lengths), max(lengths)
    rope = fold.Rope.from_theta(10000.0, head_dim, rotary_dim=head_dim // 2 if seed % 2 else head_dim)
    q = torch.randn(batch, n_q, heads_kv * group, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, max_len, heads_kv, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, max_len, heads_kv, head_dim, generator=g, dtype=torch.float64)
    if keys_rotated:
        k = apply_rope(k, torch.arange(max_len)[None, :, None], rope.inv_freq, rotary_dim=rope.rotary_dim)
    for b, length in enumerate(lengths):
        k[b, length:] = float("nan")
        v[b, length:] = float("nan")
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    kwargs = dict(window=window, rope=rope, alpha=alpha, keys_rotated=keys_rotated,
                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device))
    return (q, k, v), kwargs


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


def verify(configs: Sequence[FoldConfig] | None = None, *, dtypes=("bfloat16", "float16"), device="cpu",
           sample: int | None = None, seed: int = 0, budget_s: float | None = None, log=print, **case_args):
    """Check ``configs`` (default: the whole kept space, in a seeded random order so a time budget
    still covers every kind of tile) in each dtype with unrotated keys, and once more with rotated
    keys. Returns ``(checked, failures)``."""
    rows = case_args.get("n_q", 10) * case_args.get("group", 4)
    configs = list(configs or config_space(rows, case_args.get("head_dim", 128)))
    random.Random(seed).shuffle(configs)
    if sample is not None:
        configs = configs[:sample]
    cases = {(dt, rot): make_case(dtype=getattr(torch, dt), keys_rotated=rot, device=device, seed=seed, **case_args)
             for dt in dtypes for rot in (False, True)}
    wants = {key: expected(case) for key, case in cases.items()}
    start, checked, failures = time.monotonic(), 0, []
    for config in configs:
        for dt, rot in [(dt, False) for dt in dtypes] + [(dtypes[0], True)]:
            if budget_s is not None and time.monotonic() - start > budget_s:
                log(f"verify: time budget of {budget_s:.0f} s spent after {checked} checks")
                return checked, failures
            try:
                check_config(config, cases[dt, rot], wants[dt, rot])
            except AssertionError as exc:
                failures.append(f"{dt} keys_rotated={rot}: {exc}")
                log(f"FAIL {failures[-1]}")
            checked += 1
    return checked, failures
