"""Which launch configuration the Triton kernels use for a shape: the heuristic default.

Kept apart from the kernels so that a tuned per-device cache can be looked up here first.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import triton

from fold.kernels.fold_attention import SPACE, FoldConfig


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


def num_splits_heuristic(programs: int, n_blocks: int, num_sms: int, max_splits: int) -> int:
    """FlashAttention's wave-efficiency rule: the fewest splits within 85% of the best efficiency.

    ``programs`` run per split (batch x KV heads x M tiles); ``n_blocks`` KV tiles per sequence.
    """
    if programs >= 0.8 * num_sms or n_blocks <= 4:
        return 1
    candidates = [s for s in SPACE["num_splits"] if s <= min(max_splits, n_blocks)]

    def efficiency(s: int) -> float:
        waves = programs * s / num_sms
        return waves / -(-waves // 1)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


def heuristic_config(*, batch: int, heads_kv: int, rows: int, head_dim: int, max_len: int,
                     device: torch.device) -> FoldConfig:
    """A sound default for ``rows = n_q * group`` query rows per KV head over ``max_len`` entries."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if head_dim <= 64 else 32
    m_tiles = -(-rows // block_m)
    n_blocks = -(-max_len // block_n)
    splits = num_splits_heuristic(batch * heads_kv * m_tiles, n_blocks, _num_sms(device), max_splits=128)
    num_warps = 4 if block_m * head_dim <= 64 * 128 else 8
    return FoldConfig(block_m=block_m, block_n=block_n, num_splits=splits, num_warps=num_warps, num_stages=2)


_forced: contextvars.ContextVar[FoldConfig | None] = contextvars.ContextVar("fold_forced_config", default=None)


@contextlib.contextmanager
def use_config(config: FoldConfig):
    """Launch every Triton FOLD read inside the block with ``config`` (tests, tuning, experiments)."""
    token = _forced.set(config)
    try:
        yield config
    finally:
        _forced.reset(token)


def config_for(q: torch.Tensor, k: torch.Tensor) -> FoldConfig:
    """The configuration for ``q [B, n_q, Hq, d]`` over ``k [B, max_len, Hkv, d]``."""
    forced = _forced.get()
    if forced is not None:
        return forced
    batch, n_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    return heuristic_config(batch=batch, heads_kv=heads_kv, rows=n_q * (heads_q // heads_kv), head_dim=head_dim,
                            max_len=k.shape[1], device=q.device)
