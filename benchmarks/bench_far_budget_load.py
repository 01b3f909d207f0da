"""The budgeted read under CPU load: packed plain read, full FOLD and the two far-budget ranks, 2 threads,
side by side, without and with one busy process pinned to core 1 (issue 31, item 5, for the budget):

    python -m benchmarks.bench_far_budget_load --lengths 32768 131072 --repeats 3

Each row's slowdown under load is its median with the busy process over its median without; the goal is
fold's within 1.3x of the packed read's own. bf16 pre-RoPE cache (the fold.spec_decode layout), Llama-3.1-8B
drafter shape, budget 1024 in pages of 64 with kept bounds. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from benchmarks.workloads import DRAFTERS, make_inputs, sdpa_packed_call, timed_rows
import fold
from fold import far_pages


def rows(length: int) -> dict:
    shape = DRAFTERS["llama3.1-8b"]
    x = make_inputs(shape, length)
    bounds = far_pages.page_bounds(x["k"], 64)
    common = dict(window=x["window"], rope=x["rope"], alpha=x["alpha"], backend="torch")
    q, k, v = x["q"], x["k"], x["v"]
    return {"packed": sdpa_packed_call(x),
            "fold": lambda: fold.attention(q, k, v, **common),
            "budget-bound": lambda: fold.attention(q, k, v, **common, far_budget=1024, far_page=64, far_bounds=bounds),
            "budget-keys": lambda: fold.attention(q, k, v, **common, far_budget=1024, far_page=64, far_bounds=bounds,
                                                  far_rank="keys")}


def timed(fns: dict, repeats: int) -> dict:
    """Median milliseconds of each row, alternated after a warm-up (:func:`benchmarks.workloads.timed_rows`)."""
    return {name: t[0] * 1e3 for name, t in timed_rows(fns, repeats).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    out = []
    with torch.inference_mode():
        for length in args.lengths:
            fns = rows(length)
            quiet = timed(fns, args.repeats)
            busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(1.0)
                loaded = timed(fns, args.repeats)
            finally:
                busy.kill()
                busy.wait()
            slow = {name: loaded[name] / quiet[name] for name in fns}
            rec = dict(length=length, quiet_ms=quiet, loaded_ms=loaded, slowdown=slow,
                       vs_packed={name: slow[name] / slow["packed"] for name in fns})
            out.append(rec)
            print(json.dumps({k: (v if not isinstance(v, dict) else {n: round(x, 2) for n, x in v.items()})
                              for k, v in rec.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command="python -m benchmarks.bench_far_budget_load " + " ".join(
                sys.argv[1:] if argv is None else argv), results=out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
