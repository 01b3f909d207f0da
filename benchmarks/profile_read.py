"""Where one ``fold.attention`` read spends its time on this machine: ``torch.profiler``'s table of its ops.

A drafter's shape (default Llama-3.1-8B: n_q 10, 32/8 heads, d 128, W 2048) over one context, float32,
the torch path; a few warm-up reads, then ``--repeats`` profiled ones, ops sorted by their own CPU time::

    OMP_NUM_THREADS=2 python -m benchmarks.profile_read --length 32768 --keys-rotated
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.workloads import DRAFTERS, fold_call, make_inputs
from fold.argtypes import at_least


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=at_least(16), default=32768)
    parser.add_argument("--drafter", choices=sorted(DRAFTERS), default="llama3.1-8b")
    parser.add_argument("--keys-rotated", action="store_true", help="the cache holds rotated keys")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--rows", type=at_least(1), default=15, help="ops shown")
    args = parser.parse_args(argv)
    inputs = make_inputs(DRAFTERS[args.drafter], args.length, dtype=torch.float32, keys_rotated=args.keys_rotated)
    call = fold_call(inputs, "torch")
    for _ in range(3):
        call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.repeats):
            call()
    print(f"{args.drafter}, {args.length} entries, keys_rotated={args.keys_rotated}, {torch.get_num_threads()} "
          f"threads, {args.repeats} reads")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
