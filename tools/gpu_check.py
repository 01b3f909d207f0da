"""The one script to run on a lent H200, in under 8 minutes:

    OUT=/tmp/out python -m tools.gpu_check            # everything; results under $OUT
    python -m tools.gpu_check --dry-run                # the plan, on any machine (no GPU needed)

Sections, in order; each writes ``$OUT/results.json`` when it ends, so a run cut off keeps what is
done, and records its own failure without stopping the others:

1. ``env``: device, SMs, L2, versions, flash-attn.
2. ``precompile``: every kernel the next sections launch, compiled in parallel into Triton's cache
   (processes; the later launches then load them), with registers and spills per kernel.
3. ``verify``: every kept tile (the tuning space narrowed to 4/8 warps and 2/3 stages, without the
   tiles that spill) x every split count, bf16 and fp16, both key layouts, and ``fold.tree_attention``
   (bf16), against the float64 reference (``reference.tolerance``); within ``--verify-budget-s``.
4. ``copy_bandwidth``: a device-to-device copy, bytes read + written per second.
5. ``fused_read``: per drafter shape and length, fold with unrotated and with rotated keys (the
   config fold picks: shipped cache, else the heuristic) against torch's (or flash-attn's) flash full
   read and the paper's two-call layout; TB/s against the copy bandwidth.
6. ``graphs``: ``fold.attention`` (both layouts) and ``fold.tree_attention`` captured in CUDA graphs;
   replay equals eager, also after the inputs change in place.
7. ``tune``: the tile sweep per drafter class and layout, written to ``$OUT/configs/<device>.json``
   (copy it to ``fold/configs/`` to ship it); each class is saved as soon as it is done.
8. ``fused_read_tuned``: ``fused_read`` again with the tuned cache, if time is left.

Then ``$OUT/table.txt``. The whole run keeps to ``--budget-s``: a section that would start too late
is skipped (and says so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path


import torch
import triton

from benchmarks.workloads import DRAFTERS, PROVIDERS, flash_available, fold_call
from fold.argtypes import positive
import fold
from fold import config_lookup
from fold.files import write_text_atomically
from fold.kernels.fold_attention import FoldConfig, config_space, split_counts
from tuning.tune import drafter_classes

SECTIONS = ("env", "precompile", "verify", "copy_bandwidth", "fused_read", "graphs", "tune", "fused_read_tuned")
# the longer sequence takes 128 splits of 16-entry tiles (split_counts), the shorter leaves some empty
VERIFY_SHAPE = dict(n_q=10, group=4, heads_kv=2, head_dim=128, lengths=(4321, 1234), window=64)


def keep_tile(tile) -> bool:
    """The part of the space a lent GPU's budget allows: 64-row tiles (Hopper's wgmma; every drafter
    shape has at most 64 rows per KV head), one or two warpgroups, 2-4 stages that fit in shared
    memory. With n_q a runtime argument, one compile per tile then serves every drafter shape."""
    block_m, block_n, num_warps, num_stages = tile
    shared = config_lookup.shared_bytes_estimate(block_m, block_n, num_stages, 128, 2)
    fits = shared + config_lookup.SHARED_RESERVED_PER_CTA <= config_lookup.SHARED_BYTES_PER_SM
    return block_m == 64 and num_warps in (4, 8) and num_stages in (2, 3, 4) and fits


def kept_tiles(rows: int, head_dim: int) -> list[tuple]:
    return sorted({c.tile for c in config_space(rows, head_dim) if keep_tile(c.tile)})


def verify_configs(tiles, lengths=VERIFY_SHAPE["lengths"]) -> list[FoldConfig]:
    """Each tile with every split count fold may launch on the longest verify sequence."""
    return [FoldConfig(t[0], t[1], s, t[2], t[3]) for t in tiles for s in split_counts(max(lengths), t[1])]


def plan(args) -> dict:
    """What a run would do (``--dry-run`` prints it; works without a GPU)."""
    rows = VERIFY_SHAPE["n_q"] * VERIFY_SHAPE["group"]
    tiles = kept_tiles(rows, VERIFY_SHAPE["head_dim"])
    classes = drafter_classes(args.drafters)
    return dict(
        sections=[s for s in SECTIONS if s not in args.skip], budget_s=args.budget_s,
        verify=dict(tiles_before_spill_check=len(tiles), configs=len(verify_configs(tiles)),
                    checks_per_config=5, budget_s=args.verify_budget_s),
        fused_read=dict(drafters=list(args.drafters), lengths=args.lengths, layouts=["unrotated", "rotated"],
                        providers=["fold", "flash full read", "paper's two-call layout"]),
        tune=dict(classes=[c.class_key for c in classes], lengths=args.tune_lengths,
                  tiles_per_class={c.class_key: len(kept_tiles(c.n_q * c.group, c.head_dim)) for c in classes}),
        out=str(args.out),
    )


# --- measurements -----------------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes read + written per second of a device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def time_provider(make, inputs_list) -> float:
    from tuning.tune import cuda_graph_timer

    return cuda_graph_timer(None, [make(inputs) for inputs in inputs_list])


def fused_read_table(drafters, lengths, log, deadline) -> list[dict]:
    from tuning.tune import ShapeClass, input_copies

    flash = flash_available()
    full_name = "flash_full" if flash else "torch_flash_full"
    paper_name = "flash_paper_layout" if flash else "torch_flash_paper_layout"
    rows = []
    for name in drafters:
        shape = DRAFTERS[name]
        for length in lengths:
            if time.monotonic() > deadline:
                log(f"  fused read: out of time before {name} L={length}")
                return rows
            row = dict(drafter=name, length=length, full=full_name, paper=paper_name)
            cls = ShapeClass(shape)
            inputs = input_copies(cls, length, "cuda")                    # cold: copies beyond twice the L2
            for keys_rotated in (False, True):
                layout = "rot" if keys_rotated else "unrot"
                reads = [dict(inp, k=inp["k_rot"], keys_rotated=True) if keys_rotated else inp for inp in inputs]
                row[f"fold_{layout}_us"] = time_provider(lambda inp: fold_call(inp, "triton"), reads) * 1e6
                row[f"config_{layout}"] = config_lookup.config_for(reads[0]["q"], reads[0]["k"], keys_rotated).as_dict()
            row["full_us"] = time_provider(PROVIDERS[full_name], inputs) * 1e6
            row["paper_us"] = time_provider(PROVIDERS[paper_name], inputs) * 1e6
            del inputs
            torch.cuda.empty_cache()
            kv_bytes = 2 * length * shape.heads_kv * shape.head_dim * 2
            row["fold_tbps"] = kv_bytes / row["fold_unrot_us"] / 1e6
            row["fold_rot_tbps"] = kv_bytes / row["fold_rot_us"] / 1e6
            row["full_tbps"] = kv_bytes / row["full_us"] / 1e6
            rows.append(row)
            log(f"  {name} L={length}: fold {row['fold_unrot_us']:.1f} us (rotated keys {row['fold_rot_us']:.1f}), "
                f"{full_name} {row['full_us']:.1f} us, {paper_name} {row['paper_us']:.1f} us; "
                f"config {row['config_unrot']}")
    return rows


def graph_check(log) -> dict:
    """Replay of a captured fold.attention / fold.tree_attention equals eager, before and after the
    inputs change in place."""
    from tools.verify_configs import make_tree_case
    from benchmarks.workloads import make_inputs

    out = {}
    shape = DRAFTERS["llama3.1-8b"]
    for keys_rotated in (False, True):
        inputs = make_inputs(shape, 32768, device="cuda", keys_rotated=keys_rotated)
        seqlens = torch.tensor([32768 - 123], dtype=torch.int32, device="cuda")

        def call():
            return fold.attention(inputs["q"], inputs["k"], inputs["v"], window=inputs["window"], rope=inputs["rope"],
                                  alpha=inputs["alpha"], keys_rotated=keys_rotated, cache_seqlens=seqlens,
                                  return_lse=True, backend="triton")
        out[f"attention_{'rotated' if keys_rotated else 'unrotated'}"] = _replay_equals_eager(
            call, [inputs["q"], inputs["k"], inputs["v"]])
    (q, kc, vc, kt, vt, mask), seqlens = make_tree_case(lengths=(20000, 7777), device="cuda")

    def tree_call():
        return fold.tree_attention(q, kc, vc, kt, vt, mask, cache_seqlens=seqlens, return_lse=True, backend="triton")
    out["tree_attention"] = _replay_equals_eager(tree_call, [q, kc, vc, kt, vt])
    log(f"  {out}")
    return out


def _replay_equals_eager(call, tensors) -> dict:
    eager = call()                                      # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(captured, eager))
    g = torch.Generator(device="cuda").manual_seed(1)
    for x in tensors:                                   # new values in the same buffers
        x.copy_(torch.randn(x.shape, generator=g, device="cuda", dtype=torch.float32).to(x.dtype))
    graph.replay()
    eager = call()
    torch.cuda.synchronize()
    same_after = all(torch.equal(a, b) for a, b in zip(captured, eager))
    return dict(replay_equals_eager=same, after_inputs_change=same_after)


def precompile(tiles, classes, args, log) -> dict:
    """Every kernel that verify (varlen, NaN padding, bf16/fp16, both layouts, tree) and tune (each
    class's tiles) launch, compiled in worker processes into Triton's cache. Returns per spec the
    registers/spills Triton's compiler reports for sm_90, and which tiles spill (kept out of verify)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tools.static_report import compile_read

    verify = dict(heads_q=VERIFY_SHAPE["heads_kv"] * VERIFY_SHAPE["group"], heads_kv=VERIFY_SHAPE["heads_kv"],
                  head_dim=VERIFY_SHAPE["head_dim"], length=max(VERIFY_SHAPE["lengths"]), splits=4, seqlens=True,
                  batch=2, arch=90)
    specs = []
    for tile in tiles:
        for dtype in ("bfloat16", "float16"):
            for keys_rotated in (False, True):
                specs.append(dict(verify, kind="fold", n_q=VERIFY_SHAPE["n_q"], window=VERIFY_SHAPE["window"],
                                  keys_rotated=keys_rotated, tile=tile, dtype=dtype))
        specs.append(dict(verify, kind="tree", n_q=16, window=0, keys_rotated=True, tile=tile, dtype="bfloat16"))
    seen = set()
    for cls in classes:                                 # n_q is a runtime argument: one compile per class key
        for tile in kept_tiles(cls.n_q * cls.group, cls.head_dim):
            key = (cls.head_dim, cls.group, cls.keys_rotated, cls.dtype, tile, -(-cls.n_q * cls.group // tile[0]))
            if key in seen:
                continue
            seen.add(key)
            specs.append(dict(kind="fold", n_q=cls.n_q, heads_q=cls.heads_kv * cls.group, heads_kv=cls.heads_kv,
                              head_dim=cls.head_dim, window=cls.window, length=32768, keys_rotated=cls.keys_rotated,
                              tile=tile, splits=4, dtype=cls.dtype, seqlens=False, batch=1, arch=90))
    results = {}
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        for spec, res in zip(specs, pool.map(compile_read, specs)):
            layout = "rot" if spec["keys_rotated"] else "unrot"
            key = f"{spec['kind']}-{spec['dtype']}-{layout}-nq{spec['n_q']}-{spec['tile']}"
            results[key] = res
    spilling = sorted({tuple(s["tile"]) for s, r in zip(specs, results.values())
                       if any(x["spill_stores"] or x["spill_loads"] for x in r)})
    log(f"  {len(specs)} reads compiled; tiles that spill somewhere: {spilling}")
    return dict(reads=results, spilling_tiles=[list(t) for t in spilling])


# --- the run ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    parser.add_argument("--budget-s", type=positive(float), default=450.0, help="the whole run")
    parser.add_argument("--verify-budget-s", type=positive(float), default=60.0)
    parser.add_argument("--drafters", nargs="+", choices=sorted(DRAFTERS), default=list(DRAFTERS))
    parser.add_argument("--lengths", type=positive(int), nargs="+", default=[8192, 32768, 131072, 262144])
    parser.add_argument("--tune-lengths", type=positive(int), nargs="+", default=[8192, 32768, 131072, 262144])
    parser.add_argument("--skip", nargs="+", choices=SECTIONS, default=[])
    parser.add_argument("--workers", type=positive(int), default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return parser.parse_args(argv)


class Run:
    """One run: its output folder, log, results (saved after each section) and time budget."""

    def __init__(self, args, log_file):
        self.args, self.out, self._log_file = args, args.out, log_file
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.results = dict(plan=plan(args), errors={}, skipped=[])

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self._log_file.write(msg + "\n")
        self._log_file.flush()

    def save(self) -> None:
        write_text_atomically(self.out / "results.json", json.dumps(self.results, indent=1, default=str))

    def section(self, name: str, fn, min_left_s: float = 0.0) -> None:
        """Run ``fn`` as section ``name`` unless skipped or fewer than ``min_left_s`` seconds are left;
        its result (or its traceback) goes into the results."""
        if name in self.args.skip:
            return
        if self.left() < min_left_s:
            self.results["skipped"].append(name)
            self.log(f"== {name}: skipped, {self.left():.0f} s left")
            self.save()
            return
        t0 = time.monotonic()
        self.log(f"== {name} (at {t0 - self.start:.0f} s)")
        try:
            self.results[name] = fn()
        except Exception:  # noqa: BLE001 - one failed section must not cost the others
            self.results["errors"][name] = traceback.format_exc()
            self.log(self.results["errors"][name])
        self.log(f"   ({time.monotonic() - t0:.0f} s)")
        self.save()


def env_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return dict(device=torch.cuda.get_device_name(), sms=props.multi_processor_count,
                l2_mb=getattr(props, "L2_cache_size", 0) / 2**20, fold=fold.__version__, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, flash_attn=flash_available())


def verify_section(run: Run, tiles) -> dict:
    from tools.verify_configs import verify

    configs = verify_configs(tiles)
    checked, failures = verify(configs, dtypes=("bfloat16", "float16"), device="cuda",
                               budget_s=min(run.args.verify_budget_s, run.left() - 200), tree=True, log=run.log,
                               **VERIFY_SHAPE)
    return dict(configs=len(configs), checked=checked, failures=failures)


def tune_section(run: Run, classes, spilling: set | None) -> dict:
    """Tune one class at a time (each is saved when done); ``spilling``: the precompile's spilling
    tiles, ``None`` if it did not run (then nothing is checked)."""
    from tuning.tune import tune

    if spilling is None:
        run.log("  tune: no spill check (the precompile did not run)")

    def spill_check(cls, tile_list):
        return {t: int(spilling is not None and t in spilling) for t in tile_list}

    done = []
    for cls in classes:
        if run.left() < 60:
            run.log(f"  tune: out of time before {cls}")
            break
        tune([cls], run.args.tune_lengths, run.out / "configs", keep_tile=keep_tile, log=run.log, spills=spill_check)
        done.append(cls.class_key)
    return dict(path=str(run.out / "configs"), classes=done)


@contextlib.contextmanager
def tuning_dir(folder: Path):
    """fold reads its tuned configs from ``folder`` inside the block; the environment is restored after."""
    old = os.environ.get("FOLD_TUNING_DIR")
    os.environ["FOLD_TUNING_DIR"] = str(folder)
    config_lookup.clear_cache()
    try:
        yield
    finally:
        if old is None:
            del os.environ["FOLD_TUNING_DIR"]
        else:
            os.environ["FOLD_TUNING_DIR"] = old
        config_lookup.clear_cache()


def run_sections(run: Run) -> None:
    args, results = run.args, run.results
    tiles = kept_tiles(VERIFY_SHAPE["n_q"] * VERIFY_SHAPE["group"], VERIFY_SHAPE["head_dim"])
    classes = drafter_classes(args.drafters)
    run.section("env", env_info)
    run.section("precompile", lambda: precompile(tiles, classes, args, run.log), min_left_s=240)
    spilling = {tuple(t) for t in results.get("precompile", {}).get("spilling_tiles", [])}
    run.section("verify", lambda: verify_section(run, [t for t in tiles if t not in spilling]), min_left_s=220)
    run.section("copy_bandwidth", lambda: copy_bandwidth() / 1e12)
    run.section("fused_read", lambda: fused_read_table(args.drafters, args.lengths, run.log, run.deadline - 150),
                min_left_s=160)
    run.section("graphs", lambda: graph_check(run.log), min_left_s=120)
    run.section("tune", lambda: tune_section(run, classes, spilling if "precompile" in results else None),
                min_left_s=90)
    if (run.out / "configs").is_dir():
        def tuned_read():
            with tuning_dir(run.out / "configs"):
                return fused_read_table(args.drafters, args.lengths, run.log, run.deadline - 5)
        run.section("fused_read_tuned", tuned_read, min_left_s=40)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(plan(args), indent=1))
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to see the plan)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "log.txt", "w") as log_file:
        run = Run(args, log_file)
        run_sections(run)
        table = render_table(run.results)
        (args.out / "table.txt").write_text(table + "\n")
        run.log(table)
        run.log(f"total {time.monotonic() - run.start:.0f} s")
    results = run.results
    failures = results.get("verify", {}).get("failures")
    graphs_ok = all(v.get("replay_equals_eager") and v.get("after_inputs_change")
                    for v in results.get("graphs", {}).values())
    return 1 if results["errors"] or failures or not graphs_ok else 0


def render_table(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"{env.get('device', '?')}  torch {env.get('torch', '?')}  triton {env.get('triton', '?')}  "
             f"flash-attn {'yes' if env.get('flash_attn') else 'no'}"]
    if "verify" in results:
        v = results["verify"]
        lines.append(f"verify: {v['checked']} checks of {v['configs']} configs (x5 reads), "
                     f"{len(v['failures'])} failures")
    bw = results.get("copy_bandwidth")
    if bw:
        lines.append(f"copy bandwidth: {bw:.2f} TB/s")
    if "graphs" in results:
        lines.append(f"CUDA graphs: {results['graphs']}")
    for name, title in (("fused_read", "heuristic / shipped configs"), ("fused_read_tuned", "tuned in this run")):
        if not results.get(name):
            continue
        lines.append(f"\nfused read, {title}:")
        lines.append(f"{'drafter':<12} {'L':>7} {'fold us':>8} {'rot us':>8} {'TB/s':>5} {'%copy':>6} {'flash us':>8} "
                     f"{'paper us':>8} {'vs flash':>8} {'vs paper':>8} {'rot/unrot':>9}")
        for r in results[name]:
            pct = 100 * r["fold_tbps"] / bw if bw else math.nan
            lines.append(f"{r['drafter']:<12} {r['length']:>7} {r['fold_unrot_us']:>8.1f} {r['fold_rot_us']:>8.1f} "
                         f"{r['fold_tbps']:>5.2f} {pct:>5.0f}% {r['full_us']:>8.1f} {r['paper_us']:>8.1f} "
                         f"{r['fold_unrot_us'] / r['full_us']:>7.2f}x {r['fold_unrot_us'] / r['paper_us']:>7.2f}x "
                         f"{r['fold_rot_us'] / r['fold_unrot_us']:>8.2f}x")
    if results.get("skipped"):
        lines.append(f"skipped (out of time): {', '.join(results['skipped'])}")
    if results.get("errors"):
        lines.append(f"errors in: {', '.join(results['errors'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
