"""τ, TPOT, speedup against AR, and paired-bootstrap confidence intervals (paper Appendix B.5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fold.checks import check_float, check_int


def per_sequence_tau(result) -> list[float]:
    """Tokens committed per verification round of each sequence, the target's token included."""
    return [sum(s["committed_per_round"]) / max(1, s["rounds"]) for s in result.stats["per_sequence"]]


def per_sequence_speedup(result, ar_result) -> list[float]:
    """``TPOT_AR / TPOT`` per sequence (TPOT: decode time after the first token / further tokens)."""
    ours, theirs = result.stats["per_sequence"], ar_result.stats["per_sequence"]
    if len(ours) != len(theirs):
        raise ValueError(f"result and ar_result must hold the same sequences, got {len(ours)} and {len(theirs)}")
    return [a["tpot_s"] / s["tpot_s"] for s, a in zip(result.stats["per_sequence"], ar_result.stats["per_sequence"])]


def bootstrap_ci(groups: Sequence[Sequence[float]], *, n_resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """Mean over groups (each group = one task, equal weight) of per-request values, with its
    bootstrap CI: requests are resampled with replacement separately within each group.

    For a paired comparison pass per-request paired quantities (e.g. speedup ratios, or
    differences of τ between two methods on the same requests). Returns ``(mean, low, high)``.
    """
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or \
            any(isinstance(g, (str, bytes)) or not isinstance(g, Sequence) for g in groups):
        raise TypeError("groups must be a list of lists of numbers (one list per task)")
    check_int("n_resamples", n_resamples, 1, expected="a positive int")
    check_float("confidence", confidence, 0, 1, open_low=True, open_high=True, expected="a float in (0, 1)")
    tensors = [torch.as_tensor(list(g), dtype=torch.float64) for g in groups]
    if not tensors or any(t.numel() == 0 for t in tensors):
        raise ValueError("every group needs at least one value")
    if any(not bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError("every value must be finite (a NaN or inf would make the interval meaningless)")
    gen = torch.Generator().manual_seed(seed)
    point = torch.stack([t.mean() for t in tensors]).mean()
    means = torch.zeros(n_resamples, dtype=torch.float64)
    for t in tensors:
        idx = torch.randint(0, t.numel(), (n_resamples, t.numel()), generator=gen)
        means += t[idx].mean(dim=1)
    means /= len(tensors)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return float(point), float(low), float(high)
