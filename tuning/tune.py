"""The sweep: shape classes -> timed candidates -> a per-device JSON cache ``fold`` reads at runtime.

Per shape class (head_dim, GQA group, n_q, dtype, key layout) the sweep runs in two stages, since
the tile shape hardly depends on the length while the split count does:

1. tiles: every (block_m, block_n, num_warps, num_stages) of the kept space at one reference length,
   with the heuristic's split count; the ``top_k`` fastest go on;
2. splits: per length bucket, those tiles x every split count, plus the heuristic config itself,
   so the winner is never slower than the default under the same timer.

Timing is injectable: ``timer(config, calls) -> seconds`` where ``calls`` launch the read on
distinct input copies. :func:`cuda_graph_timer` (the default on a GPU) captures the calls in one
CUDA graph and times its replays with events; tests pass a fake timer.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

import fold
from fold import config_lookup
from fold.config_lookup import heuristic_config, shape_key
from fold.kernels.fold_attention import SPACE, FoldConfig, config_space
from tuning.workloads import DrafterShape, fold_call, make_inputs

Timer = Callable[[FoldConfig, Sequence[Callable[[], object]]], float]
BUCKETS = tuple(2**i for i in range(10, 19))          # 1K ... 256K


@dataclass(frozen=True)
class ShapeClass:
    head_dim: int = 128
    group: int = 4
    n_q: int = 10
    dtype: str = "bfloat16"
    keys_rotated: bool = False
    heads_kv: int = 8            # for timing only; not part of the key
    window: int = 2048

    def key(self, length: int) -> str:
        return shape_key(head_dim=self.head_dim, group=self.group, n_q=self.n_q, dtype=getattr(torch, self.dtype),
                         keys_rotated=self.keys_rotated, max_len=length)

    def drafter(self) -> DrafterShape:
        return DrafterShape("tuned", n_q=self.n_q, heads_q=self.heads_kv * self.group, heads_kv=self.heads_kv,
                            head_dim=self.head_dim, window=self.window)


def _tiles(configs: Sequence[FoldConfig]) -> list[tuple]:
    return sorted({(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in configs})


def candidates(cls: ShapeClass, length: int, tiles: Sequence[tuple], device) -> list[FoldConfig]:
    """Configs timed for one bucket: ``tiles`` x every useful split count, and the heuristic."""
    out = []
    for (bm, bn, warps, stages), splits in itertools.product(tiles, SPACE["num_splits"]):
        if splits == 1 or splits <= triton.cdiv(length, bn):
            out.append(FoldConfig(bm, bn, splits, warps, stages))
    default = heuristic_config(batch=1, heads_kv=cls.heads_kv, rows=cls.n_q * cls.group, head_dim=cls.head_dim,
                               max_len=length, device=device)
    return out + ([default] if default not in out else [])


def plan(cls: ShapeClass, lengths: Sequence[int], device, top_k: int = 3) -> dict:
    """What a sweep would time, without timing (``--dry-run``)."""
    space = config_space(cls.n_q * cls.group, cls.head_dim)
    tiles = _tiles(space)
    return dict(shape_class=cls.__dict__, tiles=len(tiles), top_k=top_k,
                buckets={cls.key(n): len(candidates(cls, n, tiles[:top_k], device)) for n in lengths})


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


def _calls(cls: ShapeClass, length: int, config: FoldConfig, inputs: Sequence[dict]):
    def launcher(inp):
        call = fold_call(inp, "triton")

        def run():
            with config_lookup.use_config(config):
                return call()
        return run
    return [launcher(inp) for inp in inputs]


def _input_copies(cls: ShapeClass, length: int, device, l2_bytes: int = 64 << 20, max_copies: int = 8):
    bytes_per = 2 * length * cls.heads_kv * cls.head_dim * torch.finfo(getattr(torch, cls.dtype)).bits // 8
    copies = max(1, min(max_copies, math.ceil(2 * l2_bytes / bytes_per)))
    return [make_inputs(cls.drafter(), length, dtype=getattr(torch, cls.dtype), device=device,
                        keys_rotated=cls.keys_rotated, seed=i) for i in range(copies)]


def tune_class(cls: ShapeClass, lengths: Sequence[int], timer: Timer, device, top_k: int = 3,
               keep_tile: Callable[[FoldConfig], bool] | None = None, log: Callable[[str], None] = print) -> dict:
    """Entries ``{key: {"config", "us", "heuristic_us"}}`` for one shape class; ``keep_tile`` narrows
    the tile stage (e.g. to fit a time budget)."""
    space = [c for c in config_space(cls.n_q * cls.group, cls.head_dim) if keep_tile is None or keep_tile(c)]
    ref_len = min(lengths, key=lambda n: abs(math.log2(n / 32768)))
    ref_inputs = _input_copies(cls, ref_len, device)
    splits = heuristic_config(batch=1, heads_kv=cls.heads_kv, rows=cls.n_q * cls.group, head_dim=cls.head_dim,
                              max_len=ref_len, device=device).num_splits
    tile_times = {}
    for tile in _tiles(space):
        config = FoldConfig(tile[0], tile[1], splits, tile[2], tile[3])
        tile_times[tile] = timer(config, _calls(cls, ref_len, config, ref_inputs))
    best_tiles = sorted(tile_times, key=tile_times.get)[:top_k]
    log(f"{cls}: best tiles at {ref_len}: {best_tiles}")
    entries = {}
    for length in lengths:
        inputs = ref_inputs if length == ref_len else _input_copies(cls, length, device)
        default = heuristic_config(batch=1, heads_kv=cls.heads_kv, rows=cls.n_q * cls.group, head_dim=cls.head_dim,
                                   max_len=length, device=device)
        times = {c: timer(c, _calls(cls, length, c, inputs)) for c in candidates(cls, length, best_tiles, device)}
        best = min(times, key=times.get)
        entries[cls.key(length)] = dict(config=best.as_dict(), us=times[best] * 1e6, heuristic_us=times[default] * 1e6)
        log(f"  {cls.key(length)}: {best} {times[best] * 1e6:.1f} us (heuristic {times[default] * 1e6:.1f} us)")
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
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if all(old["_metadata"].get(k) == meta[k] for k in ("device", "kernel_hash", "space_hash")):
                merged = old["entries"]
        except (ValueError, KeyError):
            pass
    merged.update(entries)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"_metadata": meta, "entries": dict(sorted(merged.items()))}, f, indent=1)
    os.replace(tmp, path)
    config_lookup.clear_cache()
    return path


def tune(classes: Sequence[ShapeClass], lengths: Sequence[int], out_dir: Path, *, timer: Timer | None = None,
         device=None, top_k: int = 3, keep_tile: Callable[[FoldConfig], bool] | None = None,
         log: Callable[[str], None] = print) -> Path:
    """Sweep every class over ``lengths`` and write the cache; returns its path."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if timer is None:
        if device.type != "cuda":
            raise ValueError("timing needs a GPU (the interpreter's timings mean nothing); use --dry-run on a CPU")
        timer = cuda_graph_timer
    entries = {}
    for cls in classes:
        entries.update(tune_class(cls, lengths, timer, device, top_k=top_k, keep_tile=keep_tile, log=log))
    return write_cache(out_dir, device, entries, getattr(timer, "__name__", type(timer).__name__))
