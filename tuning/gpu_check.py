"""The one script to run on a lent GPU (under 8 minutes on an H200):

(a) every config of the space against the reference, in bf16 and fp16 (real bf16 kernels, not the
    interpreter's upcast path), within a time budget;
(b) device copy bandwidth (bytes read + written per second);
(c) the fused FOLD read at 8K-256K for the drafter shapes: time, achieved bandwidth, and the ratio
    to one flash full read and to the paper's two-call layout (flash-attn if importable, else
    torch's CUDA flash kernel);
(d) tuning: the JSON cache for the drafter classes, written to ``$OUT/configs/<device>.json``;
(e) everything under ``$OUT`` (``results.json``, ``table.txt``), and the table printed last.

    OUT=/tmp/out python tuning/gpu_check.py
    python tuning/gpu_check.py --verify-budget-s 60 --lengths 8192 131072 --skip-tune

Each section records its own failure and the script goes on, so one run always yields a report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fold  # noqa: E402
from tuning.tune import ShapeClass, _input_copies, cuda_graph_timer, tune  # noqa: E402
from tuning.verify import verify  # noqa: E402
from tuning.workloads import DRAFTERS, PROVIDERS, flash_available, fold_call  # noqa: E402


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
    calls = [make(inputs) for inputs in inputs_list]
    return cuda_graph_timer(None, calls)


def fused_read_table(lengths, log) -> list[dict]:
    flash = flash_available()
    full_name = "flash_full" if flash else "torch_flash_full"
    paper_name = "flash_paper_layout" if flash else "torch_flash_paper_layout"
    rows = []
    for name, shape in DRAFTERS.items():
        for length in lengths:
            cls = ShapeClass(head_dim=shape.head_dim, group=shape.heads_q // shape.heads_kv, n_q=shape.n_q,
                             heads_kv=shape.heads_kv, window=shape.window)
            inputs = _input_copies(cls, length, "cuda")               # cold: copies beyond twice the L2
            t_fold = time_provider(lambda inp: fold_call(inp, "triton"), inputs)
            t_full = time_provider(PROVIDERS[full_name], inputs)
            t_paper = time_provider(PROVIDERS[paper_name], inputs)
            kv_bytes = 2 * length * shape.heads_kv * shape.head_dim * 2
            rows.append(dict(drafter=name, length=length, fold_us=t_fold * 1e6, full_us=t_full * 1e6,
                             paper_us=t_paper * 1e6, fold_tbps=kv_bytes / t_fold / 1e12,
                             vs_full=t_fold / t_full, vs_paper=t_fold / t_paper, full=full_name, paper=paper_name))
            log(f"  {name} L={length}: fold {t_fold * 1e6:.1f} us, {full_name} {t_full * 1e6:.1f} us, "
                f"{paper_name} {t_paper * 1e6:.1f} us")
            del inputs
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verify-budget-s", type=float, default=150.0)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072, 262144])
    parser.add_argument("--tune-lengths", type=int, nargs="+", default=[1024, 4096, 8192, 32768, 131072, 262144])
    parser.add_argument("--skip-tune", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 2
    out = Path(os.environ.get("OUT") or "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "log.txt", "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    results = dict(device=torch.cuda.get_device_name(), fold=fold.__version__, torch=torch.__version__,
                   triton=triton.__version__, cuda=torch.version.cuda, flash_attn=flash_available(), errors={})

    def section(name, fn):
        t0 = time.monotonic()
        log(f"== {name}")
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - one failed section must not cost the others
            results["errors"][name] = traceback.format_exc()
            log(results["errors"][name])
        log(f"   ({time.monotonic() - t0:.0f} s)")

    def run_verify():
        checked, failures = verify(dtypes=("bfloat16", "float16"), device="cuda", budget_s=args.verify_budget_s,
                                   log=log)
        return dict(checked=checked, failures=failures)

    section("verify", run_verify)
    section("copy_bandwidth_tbps", lambda: copy_bandwidth() / 1e12)
    section("fused_read", lambda: fused_read_table(args.lengths, log))
    if not args.skip_tune:
        classes = [ShapeClass(n_q=10), ShapeClass(n_q=10, keys_rotated=True), ShapeClass(n_q=7)]
        keep_tile = lambda c: c.num_stages in (2, 3) and c.num_warps in (4, 8)  # noqa: E731 - fits the budget
        section("tune", lambda: str(tune(classes, args.tune_lengths, out / "configs", keep_tile=keep_tile, log=log)))

    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [f"{results['device']}  torch {results['torch']}  triton {results['triton']}  "
             f"flash-attn {'yes' if results['flash_attn'] else 'no'}"]
    if "verify" in results:
        lines.append(f"verify: {results['verify']['checked']} checks, {len(results['verify']['failures'])} failures")
    bw = results.get("copy_bandwidth_tbps")
    if bw:
        lines.append(f"copy bandwidth: {bw:.2f} TB/s")
    lines.append(f"{'drafter':<12} {'L':>7} {'fold us':>9} {'TB/s':>6} {'%copy':>6} {'vs full':>8} {'vs paper':>9}")
    for r in results.get("fused_read", []):
        pct = 100 * r["fold_tbps"] / bw if bw else math.nan
        lines.append(f"{r['drafter']:<12} {r['length']:>7} {r['fold_us']:>9.1f} {r['fold_tbps']:>6.2f} {pct:>5.0f}% "
                     f"{r['vs_full']:>7.2f}x {r['vs_paper']:>8.2f}x")
    if results["errors"]:
        lines.append(f"errors in: {', '.join(results['errors'])}")
    table = "\n".join(lines)
    (out / "table.txt").write_text(table + "\n")
    log(table)
    return 1 if results["errors"] or results.get("verify", {}).get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
