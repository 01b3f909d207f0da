"""The sweep: shape classes -> timed tiles -> a per-device JSON cache ``fold`` reads at runtime.

A cache entry is a *tile* ``(block_m, block_n, num_warps, num_stages)`` per shape class (head_dim,
GQA group, n_q, dtype, key layout) and length bucket; the split count is derived at run time by the
model in :mod:`fold.config_lookup` (it depends on the batch and KV heads, which a class does not fix).
Per class the sweep runs in two stages, since the tile hardly depends on the length:

1. tiles: every tile of the kept space that compiles without spilling registers (checked offline
   for the GPU's architecture, ``tools/static_report.py``), at one reference length, each with the
   model's split count; the ``top_k`` fastest go on;
2. per length bucket: those tiles with the model's split count, and the heuristic tile; the fastest
   is the entry. For the winner, every other split count the model can pick at that length
   (:func:`~fold.kernels.fold_attention.split_counts`) is timed too and the best one is recorded
   beside the model's (``"splits"`` in the entry), so each run checks the split model.

Timing is injectable: ``timer(config, calls) -> seconds`` where ``calls`` launch the read on
distinct input copies. :func:`cuda_graph_timer` (the default on a GPU) captures the calls in one
CUDA graph and times its replays with events; tests pass a fake timer (and a fake spill check).
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

import fold
from fold import config_lookup
from fold.files import write_text_atomically
from fold.config_lookup import class_key, config_from_tile, heuristic_tile, shape_key
from fold.kernels.fold_attention import TILE_FIELDS, FoldConfig, config_space, split_counts
from benchmarks.workloads import DrafterShape, fold_call, make_inputs

Timer = Callable[[FoldConfig, Sequence[Callable[[], object]]], float]
SpillCheck = Callable[["ShapeClass", Sequence[tuple]], dict]   # (class, tiles) -> {tile: spill instructions}
BUCKETS = tuple(2**i for i in range(10, 19))          # 1K ... 256K


@dataclass(frozen=True)
class ShapeClass:
    """A drafter's attention shape (:class:`~benchmarks.workloads.DrafterShape`) read in one dtype and key
    layout; the cache key takes ``head_dim``, the GQA group, ``n_q``, dtype and layout (``heads_kv``,
    ``window`` and ``batch`` serve timing and the split model only)."""
    shape: DrafterShape
    dtype: str = "bfloat16"
    keys_rotated: bool = False
    batch: int = 1

    head_dim = property(lambda self: self.shape.head_dim)
    n_q = property(lambda self: self.shape.n_q)
    heads_kv = property(lambda self: self.shape.heads_kv)
    window = property(lambda self: self.shape.window)
    group = property(lambda self: self.shape.heads_q // self.shape.heads_kv)

    def key(self, length: int) -> str:
        return shape_key(head_dim=self.head_dim, group=self.group, n_q=self.n_q, dtype=getattr(torch, self.dtype),
                         keys_rotated=self.keys_rotated, max_len=length)

    @property
    def class_key(self) -> str:
        """The cache key without its length bucket (classes with the same one share entries)."""
        return class_key(head_dim=self.head_dim, group=self.group, n_q=self.n_q, dtype=getattr(torch, self.dtype),
                         keys_rotated=self.keys_rotated)

    def config(self, tile: tuple, length: int, sms: int, splits: int | None = None) -> FoldConfig:
        """``tile`` with the split model's count (or ``splits``) for this class at ``length``."""
        config = config_from_tile(tile, batch=self.batch, heads_kv=self.heads_kv, n_q=self.n_q, group=self.group,
                                  head_dim=self.head_dim, max_len=length, sms=sms,
                                  elt_bytes=torch.finfo(getattr(torch, self.dtype)).bits // 8)
        return config if splits is None else FoldConfig(*tile[:2], splits, *tile[2:])


def drafter_classes(drafters: Sequence[str], dtypes: Sequence[str] = ("bfloat16",),
                    layouts: Sequence[bool] = (False, True)) -> list[ShapeClass]:
    """One class per distinct cache class key among the named drafter shapes (``benchmarks.workloads.DRAFTERS``)
    x dtypes x key layouts (``keys_rotated``); n_q 7 and 8 share one."""
    from benchmarks.workloads import DRAFTERS

    classes = {}
    for name in drafters:
        shape = DRAFTERS[name]
        for dtype in dtypes:
            for keys_rotated in layouts:
                cls = ShapeClass(shape, dtype=dtype, keys_rotated=keys_rotated)
                classes.setdefault(cls.class_key, cls)
    return list(classes.values())


def _tiles(configs: Sequence[FoldConfig]) -> list[tuple]:
    return sorted({c.tile for c in configs})


def plan(cls: ShapeClass, lengths: Sequence[int], top_k: int = 3,
         keep_tile: Callable[[tuple], bool] | None = None) -> dict:
    """What a sweep would time, without timing (``--dry-run``): the tiles of the tile stage (before
    spilling ones are dropped) and, per bucket, at most how many configs (top tiles, the heuristic
    tile, the winner's other split counts)."""
    tiles = [t for t in _tiles(config_space(cls.n_q * cls.group, cls.head_dim)) if keep_tile is None or keep_tile(t)]
    smallest_n = min((t[1] for t in tiles), default=16)
    return dict(shape_class=dict(asdict(cls.shape), dtype=cls.dtype, keys_rotated=cls.keys_rotated), tiles=len(tiles), top_k=top_k,
                buckets={cls.key(n): min(top_k, len(tiles)) + 1 + len(split_counts(n, smallest_n)) - 1
                         for n in lengths})


def static_spills(arch: int) -> SpillCheck:
    """The spill check of a real sweep: compile the class's stage-1 kernels (both branches) of each
    tile for ``sm_<arch>`` (no launch, in parallel) and count spill stores and loads in their SASS."""
    from tools import static_report

    def spills(cls: ShapeClass, tiles: Sequence[tuple]) -> dict:
        return static_report.stage1_spills(cls.shape, cls.keys_rotated, tiles, arch=arch)
    return spills


def cuda_graph_timer(config: FoldConfig, calls: Sequence[Callable[[], object]], replays: int = 10) -> float:
    """Seconds per call: the calls (distinct input copies, so the cache is cold) captured in one CUDA
    graph, replayed ``replays`` times and timed with CUDA events; configs that fail score inf."""
    try:
        for call in calls:                     # compile and warm up outside the capture
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        torch.cuda.synchronize()
    except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:  # e.g. shared memory
        print(f"  skip {config}: {type(exc).__name__}")
        return math.inf
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def _calls(cls: ShapeClass, config: FoldConfig, inputs: Sequence[dict]):
    def launcher(inp):
        call = fold_call(inp, "triton")

        def run():
            with config_lookup.use_config(config):
                return call()
        return run
    return [launcher(inp) for inp in inputs]


def input_copies(cls: ShapeClass, length: int, device, l2_bytes: int = 64 << 20, max_copies: int = 8) -> list[dict]:
    """Distinct inputs of one read of ``cls`` at ``length`` (:func:`benchmarks.workloads.make_inputs`), as
    many as twice the L2 holds (at most ``max_copies``), so timed calls read a cold cache."""
    bytes_per = 2 * length * cls.heads_kv * cls.head_dim * torch.finfo(getattr(torch, cls.dtype)).bits // 8
    copies = max(1, min(max_copies, math.ceil(2 * l2_bytes / bytes_per)))
    return [make_inputs(cls.shape, length, dtype=getattr(torch, cls.dtype), device=device,
                        keys_rotated=cls.keys_rotated, seed=i) for i in range(copies)]


def tune_class(cls: ShapeClass, lengths: Sequence[int], timer: Timer, device, top_k: int = 3,
               keep_tile: Callable[[tuple], bool] | None = None, spills: SpillCheck | None = None,
               sms: int | None = None, log: Callable[[str], None] = print) -> dict:
    """Entries ``{key: {"config", "us", "heuristic_us", "splits"}}`` for one shape class.

    ``keep_tile`` narrows the tile stage (e.g. to fit a time budget); ``spills(cls, tile)`` counts
    a tile's register spills (tiles with any are never timed; default: none checked); ``sms`` is
    the SM count the split model assumes (default: the device's).
    """
    sms = sms or config_lookup.num_sms(torch.device(device))
    tiles = [t for t in _tiles(config_space(cls.n_q * cls.group, cls.head_dim)) if keep_tile is None or keep_tile(t)]
    if spills is not None:
        counts = spills(cls, tiles)
        spilling = [t for t in tiles if counts[t]]
        if spilling:
            log(f"{cls}: skip {len(spilling)} tiles that spill registers: {spilling}")
        tiles = [t for t in tiles if t not in spilling]
    if not tiles:
        raise ValueError(f"{cls}: no tile of the space is left to time")
    default = heuristic_tile(rows=cls.n_q * cls.group, head_dim=cls.head_dim)
    ref_len = min(lengths, key=lambda n: abs(math.log2(n / 32768)))
    ref_inputs = input_copies(cls, ref_len, device)

    def time_config(config, inputs):
        return timer(config, _calls(cls, config, inputs))

    tile_times = {t: time_config(cls.config(t, ref_len, sms), ref_inputs) for t in tiles}
    best_tiles = sorted(tile_times, key=tile_times.get)[:top_k]
    log(f"{cls}: best tiles at {ref_len}: {best_tiles}")
    entries = {}
    for length in lengths:
        inputs = ref_inputs if length == ref_len else input_copies(cls, length, device)
        times = {t: time_config(cls.config(t, length, sms), inputs) for t in dict.fromkeys([*best_tiles, default])}
        best = min(times, key=times.get)
        model = cls.config(best, length, sms).num_splits
        split_times = {s: time_config(cls.config(best, length, sms, splits=s), inputs)
                       for s in split_counts(length, best[1]) if s != model}
        split_times[model] = times[best]
        best_split = min(split_times, key=split_times.get)
        entries[cls.key(length)] = dict(
            config=dict(zip(TILE_FIELDS, best)), us=times[best] * 1e6, heuristic_us=times[default] * 1e6,
            splits=dict(model=model, best=best_split, best_us=split_times[best_split] * 1e6, programs=cls.batch *
                        cls.heads_kv * triton.cdiv(cls.n_q * cls.group, best[0]), sms=sms))
        log(f"  {cls.key(length)}: tile {best} {times[best] * 1e6:.1f} us with the model's {model} splits "
            f"(best split {best_split}: {split_times[best_split] * 1e6:.1f} us; heuristic tile "
            f"{times[default] * 1e6:.1f} us)")
    return entries


def metadata(device, timer_name: str) -> dict:
    return dict(
        device=config_lookup.device_name(device), kernel_hash=config_lookup.kernel_hash(),
        space_hash=config_lookup.space_hash(), fold=fold.__version__, triton=triton.__version__,
        torch=torch.__version__, cuda=torch.version.cuda, timer=timer_name,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def write_cache(out_dir: Path, device, entries: dict, timer_name: str) -> Path:
    """Merge ``entries`` into ``out_dir/<device>.json`` (if its metadata matches), atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = metadata(device, timer_name)
    path = out_dir / f"{meta['device']}.json"
    merged = {}
    if path.is_file():                          # keep the old file's valid entries if tuned for these kernels
        try:
            old_meta, old_entries, _, old = config_lookup.read_cache_file(path)
        except config_lookup.CacheError:
            old_meta, old_entries = {}, {}
        if all(old_meta.get(k) == meta[k] for k in ("device", "kernel_hash", "space_hash")):
            merged = {key: old["entries"][key] for key in old_entries}
    merged.update(entries)
    write_text_atomically(path, json.dumps({"_metadata": meta, "entries": dict(sorted(merged.items()))}, indent=1))
    config_lookup.clear_cache()
    return path


def tune(classes: Sequence[ShapeClass], lengths: Sequence[int], out_dir: Path, *, timer: Timer | None = None,
         device=None, top_k: int = 3, keep_tile: Callable[[tuple], bool] | None = None,
         spills: SpillCheck | None = None, log: Callable[[str], None] = print) -> Path:
    """Sweep every class over ``lengths`` and write the cache; returns its path. On a GPU the
    default timer is :func:`cuda_graph_timer` and the default spill check :func:`static_spills`."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if timer is None:
        if device.type != "cuda":
            raise ValueError("timing needs a GPU (the interpreter's timings mean nothing); use --dry-run on a CPU")
        timer = cuda_graph_timer
        if spills is None:
            major, minor = torch.cuda.get_device_capability(device)
            spills = static_spills(10 * major + minor)
    entries = {}
    for cls in classes:
        entries.update(tune_class(cls, lengths, timer, device, top_k=top_k, keep_tile=keep_tile, spills=spills,
                                  log=log))
    return write_cache(out_dir, device, entries, getattr(timer, "__name__", type(timer).__name__))
