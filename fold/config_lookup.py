"""Which launch configuration the Triton kernels use for a shape.

A configuration is a *tile* ``(block_m, block_n, num_warps, num_stages)`` and a split count. The tile
comes from, in order (a dict lookup after the first call):

1. a config forced with :func:`use_config` (tests, the tuner, experiments; its split count too);
2. ``$FOLD_TUNING_DIR/<device>.json``, written by ``python -m tuning tune``;
3. ``fold/configs/<device>.json`` shipped with the package;
4. :func:`heuristic_tile`.

A cache file is used only if its ``_metadata`` names this device and the kernels and config space
it was tuned for (source hashes); otherwise it is ignored with one warning. Every entry is checked
against the declared space (:data:`fold.kernels.fold_attention.SPACE`); a bad entry is ignored with
a warning naming the file, the entry and the field. Entries are keyed by shape class
(:func:`shape_key`); a missing length bucket falls back to the nearest tuned bucket of the same class.

The split count is not cached: it depends on how many programs share the GPU (``batch x heads_kv x
m_tiles``), which a shape class does not fix. :func:`num_splits_for` derives it at run time.

Split model
-----------
Stage 1 runs ``P x S`` CTAs (``P = batch * heads_kv * m_tiles`` programs, ``S`` splits), each
streaming ``1/S`` of its KV head's cache. The read is bandwidth-bound, and the device reaches its
bandwidth only while all of its ``slots = num_sms * resident`` CTA slots are busy (``resident``: CTAs
of this tile that fit on one SM by shared memory and registers, :func:`resident_ctas`). With
``waves = ceil(P S / slots)`` the busy fraction of the slot-time is the wave efficiency
``eff(S) = P S / (waves * slots)``. Every split also writes one fp32 partial state per row, which
stage 2 reads back: ``merge(S) = S * batch * heads_q * n_q * head_dim * 4 B * 2``. So::

    time(S)  ~  (kv_bytes + merge(S)) / eff(S)

and :func:`num_splits_for` takes the split count that minimises it (the fewest on ties) among
:func:`~fold.kernels.fold_attention.split_counts` (the declared space, at least two key tiles per
split). This is FlashAttention's wave-efficiency rule with the slot count of the tile instead of the
SM count, plus the merge traffic that makes many splits lose on short caches.

Checked against ``results/tools/h200-2026-11-29-gpu_check.log`` (a stage-1 kernel of 8 warps, one
CTA per SM, so ``slots = 132``; Llama-3.1-8B drafter, ``P = 8``): the model gives 16 splits at 8K
(``eff = 128/132``; 8 splits fill half the GPU, 32 double the merge traffic for the same
efficiency) and at 128K, the split that sweep picked at both. ``python -m tuning tune`` records, per
bucket, the model's split beside the best one it timed (``tuning/SPLITS.md``).
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

from fold.checks import is_int
from fold.kernels import fold_attention as _kernels
from fold.kernels.fold_attention import SPACE, TILE_FIELDS, FoldConfig, split_counts

SHIPPED_DIR = Path(__file__).parent / "configs"
MIN_BUCKET, MAX_BUCKET = 1024, 262144
# Hopper (sm_90): 228 KiB of shared memory per SM, of which the system reserves 1 KiB per CTA, so one
# CTA gets at most 227 KiB (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability")
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024
MAX_REGISTERS_PER_THREAD = 255        # the static report checks that fold's kernels stay at or below it


class CacheError(ValueError):
    """A tuned-config file that cannot be used at all (unreadable, not JSON, wrong structure)."""


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


def class_key(*, head_dim: int, group: int, n_q: int, dtype: torch.dtype, keys_rotated: bool) -> str:
    """Shape class of one FOLD read, without its length bucket: ``d128-g4-nq16-bfloat16-unrotated``."""
    layout = "rotated" if keys_rotated else "unrotated"
    dtype_name = str(dtype).removeprefix("torch.")
    return f"d{head_dim}-g{group}-nq{triton.next_power_of_2(n_q)}-{dtype_name}-{layout}"


def shape_key(*, head_dim: int, group: int, n_q: int, dtype: torch.dtype, keys_rotated: bool, max_len: int) -> str:
    """Cache key of one FOLD read: its class and length bucket, ``d128-g4-nq16-bfloat16-unrotated-L32768``."""
    cls = class_key(head_dim=head_dim, group=group, n_q=n_q, dtype=dtype, keys_rotated=keys_rotated)
    return f"{cls}-L{length_bucket(max_len)}"


def split_key(key: str) -> tuple[str, int]:
    """``(class key, length bucket)`` of a cache key (:func:`shape_key`); ``ValueError`` if it has
    no ``-L<digits>`` suffix."""
    head, sep, bucket = key.rpartition("-L")
    if not sep or not head or not bucket.isdigit():
        raise ValueError("key must look like 'd128-g4-nq16-bfloat16-unrotated-L32768'")
    return head, int(bucket)


def check_key(key) -> str | None:
    """Why ``key`` is not a cache key (:func:`shape_key`), or ``None``."""
    if not isinstance(key, str):
        return f"key must be a string, got {type(key).__name__}"
    try:
        _, bucket = split_key(key)
    except ValueError as exc:
        return str(exc)
    if bucket != length_bucket(bucket):
        return f"length bucket L{bucket} must be a power of two in [{MIN_BUCKET}, {MAX_BUCKET}]"
    return None


def check_tile(config) -> str | None:
    """Why ``config`` (an entry's ``"config"``) is not a tile of the declared space, or ``None``;
    the message names the field."""
    if not isinstance(config, dict):
        return f"'config' must be an object with {', '.join(TILE_FIELDS)}, got {type(config).__name__}"
    for field in TILE_FIELDS:
        if field not in config:
            return f"config field '{field}' is missing"
    for field in config:
        if field not in TILE_FIELDS:
            why = " (split counts are derived at run time, not cached)" if field == "num_splits" else ""
            return f"config field '{field}' is not a tile field{why}"
    for field in TILE_FIELDS:
        value = config[field]
        if not is_int(value):
            return f"config field '{field}' must be an integer, got {value!r}"
        if value not in SPACE[field]:
            return f"config field '{field}' = {value} is not in the declared space {SPACE[field]}"
    return None


def parse_cache(data, path) -> tuple[dict, dict[str, tuple[int, ...]], list[str]]:
    """Check decoded cache JSON ``data`` read from ``path``.

    Returns ``(metadata, {key: tile}, problems)``: the usable entries and one message per entry
    that is not (naming the file, the entry and the field). Raises :class:`CacheError` if the file
    as a whole has the wrong structure.
    """
    if not isinstance(data, dict):
        raise CacheError(f"{path}: the top level must be an object with '_metadata' and 'entries', "
                         f"got {type(data).__name__}")
    for field, kind in (("_metadata", dict), ("entries", dict)):
        if field not in data:
            raise CacheError(f"{path}: field '{field}' is missing")
        if not isinstance(data[field], kind):
            raise CacheError(f"{path}: field '{field}' must be an object, got {type(data[field]).__name__}")
    entries, problems = {}, []
    for key, entry in data["entries"].items():
        why = check_key(key)
        if why is None and not isinstance(entry, dict):
            why = f"must be an object with a 'config', got {type(entry).__name__}"
        if why is None:
            why = check_tile(entry.get("config"))
        if why is None:
            entries[key] = tuple(int(entry["config"][f]) for f in TILE_FIELDS)
        else:
            problems.append(f"{path}: entry {key!r}: {why}")
    return data["_metadata"], entries, problems


def read_cache_file(path: Path) -> tuple[dict, dict[str, tuple[int, ...]], list[str], dict]:
    """:func:`parse_cache` of the file at ``path``, plus the raw decoded data; :class:`CacheError`
    (naming the file) if it cannot be read or decoded."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CacheError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheError(f"{path}: not valid JSON ({exc})") from exc
    meta, entries, problems = parse_cache(data, path)
    return meta, entries, problems, data


@functools.lru_cache(maxsize=None)
def load_cache(folder: str, device: str) -> dict[str, tuple[int, ...]] | None:
    """Usable entries ``{key: tile}`` of ``folder/<device>.json``, or ``None`` if there is none or
    (with one warning) it does not fit these kernels; bad entries are skipped with a warning each.
    Read once per folder and device; see :func:`clear_cache`."""
    path = Path(folder) / f"{device}.json"
    if not path.is_file():
        return None
    try:
        meta, entries, problems, _ = read_cache_file(path)
    except CacheError as exc:
        warnings.warn(f"fold: ignoring tuned configs: {exc}", stacklevel=3)
        return None
    want = dict(device=device, kernel_hash=kernel_hash(), space_hash=space_hash())
    stale = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if stale:
        warnings.warn(f"fold: ignoring tuned configs {path}: tuned for other kernels or device "
                      f"({', '.join(f'{k}={a!r}, running {b!r}' for k, (a, b) in stale.items())}); "
                      "re-run `python -m tuning tune`", stacklevel=3)
        return None
    for problem in problems:
        warnings.warn(f"fold: ignoring a tuned config: {problem}", stacklevel=3)
    return entries


def clear_cache() -> None:
    """Forget the cache files read so far (after writing a new one)."""
    load_cache.cache_clear()


def tuned_tile(key: str, device: str) -> tuple[int, ...] | None:
    """The tuned tile ``(block_m, block_n, num_warps, num_stages)`` for ``key`` from the first usable
    cache file, if any."""
    for folder in filter(None, (os.environ.get("FOLD_TUNING_DIR"), str(SHIPPED_DIR))):
        entries = load_cache(folder, device)
        if not entries:
            continue
        if key in entries:
            return entries[key]
        head, bucket = split_key(key)
        same_class = [split_key(k)[1] for k in entries if split_key(k)[0] == head]
        if same_class:
            nearest = min(same_class, key=lambda b: (abs(math.log2(b / bucket)), b))
            return entries[f"{head}-L{nearest}"]
    return None


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 1 for the interpreter (programs run one at a time)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def shared_bytes_estimate(block_m: int, block_n: int, num_stages: int, head_dim: int, elt_bytes: int) -> int:
    """Shared memory of stage 1: the query tile plus ``num_stages`` K and V tiles (what Triton's
    pipeliner allocates; the static report prints the compiler's figure)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return (block_m + 2 * num_stages * block_n) * block_d * elt_bytes


def resident_ctas(tile: tuple[int, ...], head_dim: int, elt_bytes: int = 2) -> int:
    """Stage-1 CTAs of ``tile`` one SM holds at once: by shared memory, and by registers assuming
    the kernel uses at most 255 per thread (checked by ``tests/core/test_kernel_static.py``)."""
    block_m, block_n, num_warps, num_stages = tile
    by_registers = 65536 // (MAX_REGISTERS_PER_THREAD + 1) // (32 * num_warps)
    shared = shared_bytes_estimate(block_m, block_n, num_stages, head_dim, elt_bytes) + SHARED_RESERVED_PER_CTA
    return max(1, min(by_registers, SHARED_BYTES_PER_SM // shared))


def num_splits_for(*, batch: int, heads_kv: int, n_q: int, group: int, head_dim: int, max_len: int,
                   tile: tuple[int, ...], num_sms: int, elt_bytes: int = 2) -> int:
    """The split count of the model in this module's docstring for one read with ``tile``."""
    block_m, block_n = tile[0], tile[1]
    m_tiles = -(-(n_q * group) // block_m)
    programs = batch * heads_kv * m_tiles
    slots = num_sms * resident_ctas(tile, head_dim, elt_bytes)
    kv_bytes = programs * max_len * 2 * head_dim * elt_bytes
    merge_per_split = batch * heads_kv * group * n_q * head_dim * 4 * 2

    def cost(splits: int) -> float:
        ctas = programs * splits
        efficiency = ctas / (math.ceil(ctas / slots) * slots)
        return (kv_bytes + merge_per_split * splits) / efficiency

    return min(split_counts(max_len, block_n), key=lambda s: (cost(s), s))


def heuristic_tile(*, rows: int, head_dim: int) -> tuple[int, int, int, int]:
    """A sound default tile for ``rows = n_q * group`` query rows per KV head: one warpgroup over 64
    rows (Hopper's wgmma needs 64), two CTAs per SM, no spills (``tools/static_report.py``)."""
    block_m = 16 if rows <= 16 else 64 if rows <= 64 else 128
    num_warps = 8 if block_m == 128 or head_dim > 128 else 4
    return (block_m, 64, num_warps, 2)


def heuristic_config(*, batch: int, heads_kv: int, n_q: int, group: int, head_dim: int, max_len: int,
                     device: torch.device | None = None, sms: int | None = None, elt_bytes: int = 2) -> FoldConfig:
    """The heuristic tile with the model's split count, for ``sms`` SMs (default: ``device``'s)."""
    tile = heuristic_tile(rows=n_q * group, head_dim=head_dim)
    return config_from_tile(tile, batch=batch, heads_kv=heads_kv, n_q=n_q, group=group, head_dim=head_dim,
                            max_len=max_len, sms=sms if sms is not None else num_sms(device), elt_bytes=elt_bytes)


def config_from_tile(tile: tuple[int, ...], *, batch: int, heads_kv: int, n_q: int, group: int, head_dim: int,
                     max_len: int, sms: int, elt_bytes: int = 2) -> FoldConfig:
    splits = num_splits_for(batch=batch, heads_kv=heads_kv, n_q=n_q, group=group, head_dim=head_dim,
                            max_len=max_len, tile=tile, num_sms=sms, elt_bytes=elt_bytes)
    block_m, block_n, num_warps, num_stages = tile
    return FoldConfig(block_m=block_m, block_n=block_n, num_splits=splits, num_warps=num_warps, num_stages=num_stages)


_forced: contextvars.ContextVar[FoldConfig | None] = contextvars.ContextVar("fold_forced_config", default=None)


@contextlib.contextmanager
def use_config(config: FoldConfig):
    """Launch every Triton FOLD read inside the block with ``config`` (tests, tuning, experiments)."""
    token = _forced.set(config)
    try:
        yield config
    finally:
        _forced.reset(token)


def config_for(q: torch.Tensor, k: torch.Tensor, keys_rotated: bool, *, device: str | None = None,
               sms: int | None = None, block_table: torch.Tensor | None = None) -> FoldConfig:
    """The configuration for ``q [B, n_q, Hq, d]`` over ``k [B, max_len, Hkv, d]``, or over pages
    ``k [num_blocks, page_size, Hkv, d]`` with ``block_table``; ``device`` (a cache file name) and
    ``sms`` default to q's device (set them to ask for another GPU)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    batch, n_q, heads_q, head_dim = q.shape
    max_len, heads_kv = _kernels.cache_len(k, block_table), k.shape[2]
    group = heads_q // heads_kv
    key = shape_key(head_dim=head_dim, group=group, n_q=n_q, dtype=q.dtype, keys_rotated=keys_rotated,
                    max_len=max_len)
    tile = tuned_tile(key, device or device_name(q.device)) or heuristic_tile(rows=n_q * group, head_dim=head_dim)
    return config_from_tile(tile, batch=batch, heads_kv=heads_kv, n_q=n_q, group=group, head_dim=head_dim,
                            max_len=max_len, sms=sms if sms is not None else num_sms(q.device),
                            elt_bytes=k.element_size())
