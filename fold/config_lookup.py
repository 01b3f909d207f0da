"""Which launch configuration the Triton kernels use for a shape.

Lookup order, per call (a dict lookup after the first):

1. a config forced with :func:`use_config` (tests, the tuner, experiments);
2. ``$FOLD_TUNING_DIR/<device>.json``, written by ``python -m tuning tune``;
3. ``fold/configs/<device>.json`` shipped with the package;
4. the heuristic below.

A cache file is used only if its ``_metadata`` names this device and the kernels and config space
it was tuned for (source hashes); otherwise it is ignored with one warning. Entries are keyed by
shape class (:func:`shape_key`); a missing length bucket falls back to the nearest tuned bucket of
the same class.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import math
import os
import warnings
from pathlib import Path

import torch
import triton

from fold.kernels import fold_attention as _kernels
from fold.kernels.fold_attention import SPACE, FoldConfig

SHIPPED_DIR = Path(__file__).parent / "configs"
MIN_BUCKET, MAX_BUCKET = 1024, 262144


def device_name(device: torch.device) -> str:
    """File-name form of the device: ``NVIDIA_H200``; ``cpu`` for the interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")
    return device.type


@functools.lru_cache(maxsize=None)
def kernel_hash() -> str:
    """Hash of the kernel source: a cache tuned for other kernels is not trusted."""
    return hashlib.sha256(Path(_kernels.__file__).read_bytes()).hexdigest()[:16]


def space_hash() -> str:
    return hashlib.sha256(json.dumps(SPACE, sort_keys=True).encode()).hexdigest()[:16]


def length_bucket(max_len: int) -> int:
    """Powers of two from 1K to 256K."""
    return min(MAX_BUCKET, max(MIN_BUCKET, triton.next_power_of_2(max_len)))


def shape_key(*, head_dim: int, group: int, n_q: int, dtype: torch.dtype, keys_rotated: bool, max_len: int) -> str:
    """Shape class of one FOLD read, e.g. ``d128-g4-nq16-bfloat16-unrotated-L32768``."""
    layout = "rotated" if keys_rotated else "unrotated"
    dtype_name = str(dtype).removeprefix("torch.")
    return f"d{head_dim}-g{group}-nq{triton.next_power_of_2(n_q)}-{dtype_name}-{layout}-L{length_bucket(max_len)}"


def _split_key(key: str) -> tuple[str, int]:
    head, _, bucket = key.rpartition("-L")
    return head, int(bucket)


@functools.lru_cache(maxsize=None)
def load_cache(folder: str, device: str) -> dict[str, FoldConfig] | None:
    """Entries of ``folder/<device>.json``, or ``None`` if there is none or (with one warning) it
    does not fit these kernels. Read once per folder and device; see :func:`clear_cache`."""
    path = Path(folder) / f"{device}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        meta = data["_metadata"]
        want = dict(device=device, kernel_hash=kernel_hash(), space_hash=space_hash())
        stale = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
        if stale:
            warnings.warn(f"fold: ignoring tuned configs {path}: tuned for other kernels or device "
                          f"({', '.join(f'{k}={a!r}, running {b!r}' for k, (a, b) in stale.items())}); "
                          "re-run `python -m tuning tune`", stacklevel=2)
            return None
        return {key: FoldConfig(**entry["config"]) for key, entry in data["entries"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"fold: ignoring unreadable tuned configs {path}: {exc}", stacklevel=2)
        return None


def clear_cache() -> None:
    """Forget the cache files read so far (after writing a new one)."""
    load_cache.cache_clear()


def tuned_config(key: str, device: str) -> FoldConfig | None:
    """The tuned config for ``key`` from the first usable cache file, if any."""
    for folder in filter(None, (os.environ.get("FOLD_TUNING_DIR"), str(SHIPPED_DIR))):
        entries = load_cache(folder, device)
        if not entries:
            continue
        if key in entries:
            return entries[key]
        head, bucket = _split_key(key)
        same_class = [k for k in entries if _split_key(k)[0] == head]
        if same_class:
            nearest = min(same_class, key=lambda k: (abs(math.log2(_split_key(k)[1] / bucket)), _split_key(k)[1]))
            return entries[nearest]
    return None


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
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


def heuristic_config(*, batch: int, heads_kv: int, rows: int, head_dim: int, max_len: int,
                     device: torch.device) -> FoldConfig:
    """A sound default for ``rows = n_q * group`` query rows per KV head over ``max_len`` entries."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if head_dim <= 64 else 32
    m_tiles = -(-rows // block_m)
    n_blocks = -(-max_len // block_n)
    splits = num_splits_heuristic(batch * heads_kv * m_tiles, n_blocks, _num_sms(torch.device(device)),
                                  max_splits=128)
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


def config_for(q: torch.Tensor, k: torch.Tensor, keys_rotated: bool) -> FoldConfig:
    """The configuration for ``q [B, n_q, Hq, d]`` over ``k [B, max_len, Hkv, d]``."""
    forced = _forced.get()
    if forced is not None:
        return forced
    batch, n_q, heads_q, head_dim = q.shape
    max_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    key = shape_key(head_dim=head_dim, group=group, n_q=n_q, dtype=q.dtype, keys_rotated=keys_rotated,
                    max_len=max_len)
    tuned = tuned_config(key, device_name(q.device))
    if tuned is not None:
        return tuned
    return heuristic_config(batch=batch, heads_kv=heads_kv, rows=n_q * group, head_dim=head_dim, max_len=max_len,
                            device=q.device)
