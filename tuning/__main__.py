"""``python -m tuning tune|show|verify|inspect``: tune the Triton kernels for this GPU and ship the result.

    python -m tuning tune --dry-run                 # what would be timed (works on a CPU)
    python -m tuning tune                           # sweep, write fold/configs/<device>.json
    python -m tuning tune --out $FOLD_TUNING_DIR    # or a folder fold reads at runtime
    python -m tuning show fold/configs/NVIDIA_H200.json
    python -m tuning verify --sample 20             # configs vs the reference (interpreter on a CPU)
    python -m tuning inspect                        # registers/spills/shared memory on sm_90, no GPU needed
    python -m tuning inspect --json --dump cubins/  # one JSON record per launch; the cubins
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    from tuning.workloads import DRAFTERS

    buckets = [2**i for i in range(10, 19)]
    parser = argparse.ArgumentParser(prog="python -m tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_tune = sub.add_parser("tune", help="sweep the config space and write the JSON cache")
    p_tune.add_argument("--drafters", nargs="+", choices=sorted(DRAFTERS), default=sorted(DRAFTERS))
    p_tune.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=DTYPES)
    p_tune.add_argument("--layout", nargs="+", default=["unrotated", "rotated"], choices=["unrotated", "rotated"])
    p_tune.add_argument("--lengths", nargs="+", type=_positive(int), default=buckets)
    p_tune.add_argument("--top-k", type=_positive(int), default=3)
    p_tune.add_argument("--out", type=Path, default=None,
                        help="folder of the cache (default: $FOLD_TUNING_DIR, else fold/configs)")
    p_tune.add_argument("--dry-run", action="store_true", help="list the sweep without timing")
    p_show = sub.add_parser("show", help="print a cache file")
    p_show.add_argument("path", type=Path)
    p_verify = sub.add_parser("verify", help="run configs of the space against the reference")
    p_verify.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=DTYPES)
    p_verify.add_argument("--sample", type=_positive(int), default=None, help="check this many random configs")
    p_verify.add_argument("--seed", type=int, default=0)
    p_verify.add_argument("--budget-s", type=_positive(float), default=None)
    p_inspect = sub.add_parser("inspect", help="compile what fold launches for sm_90 and report registers, "
                               "spills, shared memory and wgmma (no GPU needed)")
    p_inspect.add_argument("--drafters", nargs="+", choices=sorted(DRAFTERS), default=sorted(DRAFTERS))
    p_inspect.add_argument("--layout", nargs="+", default=["unrotated", "rotated"], choices=["unrotated", "rotated"])
    p_inspect.add_argument("--lengths", nargs="+", type=_positive(int), default=None,
                           help="cache lengths (default: 8K, 32K, 128K, 256K)")
    p_inspect.add_argument("--heads-kv", nargs="+", type=_positive(int), default=None,
                           help="KV heads of each drafter shape, its query heads kept (default: 1 2 4 8)")
    p_inspect.add_argument("--device", default="NVIDIA_H200", help="the cache file name fold would read")
    p_inspect.add_argument("--sms", type=_positive(int), default=132, help="SMs the split model assumes")
    p_inspect.add_argument("--arch", type=_positive(int), default=90, help="compile for sm_<arch>")
    p_inspect.add_argument("--no-tree", action="store_true", help="leave out fold.tree_attention's launches")
    p_inspect.add_argument("--no-serving", action="store_true",
                           help="leave out the reads fold.vllm serves (window alone, sliding + causal, FP8 pages)")
    p_inspect.add_argument("--page-size", type=_positive(int), default=None,
                           help="read a paged cache (block_table) with pages of this many entries")
    p_inspect.add_argument("--json", action="store_true", help="print one JSON list, one object per launch")
    p_inspect.add_argument("--dump", type=Path, default=None, help="write each cubin into this folder")
    p_inspect.add_argument("--workers", type=_positive(int), default=None, help="parallel compiles")
    return parser


def show(path: Path) -> int:
    from fold.config_lookup import CacheError, read_cache_file

    try:
        meta, entries, problems, data = read_cache_file(path)
    except CacheError as exc:
        print(f"python -m tuning show: error: {exc}", file=sys.stderr)
        return 2
    for k, v in meta.items():
        print(f"{k:>12}: {v}")
    print(f"\n{'shape class':<44} {'bm':>4} {'bn':>4} {'warps':>5} {'stages':>6} {'us':>9} {'default us':>10} "
          f"{'splits model/best':>17}")

    def number(entry, field):
        value = entry.get(field)
        return f"{value:.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    for key, tile in entries.items():
        entry = data["entries"][key]
        splits = entry.get("splits") if isinstance(entry.get("splits"), dict) else {}
        model_best = f"{splits.get('model', '-')}/{splits.get('best', '-')}"
        print(f"{key:<44} {tile[0]:>4} {tile[1]:>4} {tile[2]:>5} {tile[3]:>6} {number(entry, 'us'):>9} "
              f"{number(entry, 'heuristic_us'):>10} {model_best:>17}")
    for problem in problems:
        print(f"python -m tuning show: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def inspect(args) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("python -m tuning inspect: error: TRITON_INTERPRET=1 is set; the report compiles the kernels, "
              "run it without the interpreter", file=sys.stderr)
        return 2
    from tuning import static_report

    try:
        items = static_report.plan(args.drafters, args.lengths or static_report.DEFAULT_LENGTHS,
                                   tuple(x == "rotated" for x in args.layout),
                                   heads_kv=args.heads_kv or static_report.DEFAULT_HEADS_KV, tree=not args.no_tree,
                                   device=args.device, sms=args.sms, page_size=args.page_size or 0,
                                   serving=not args.no_serving)
    except ValueError as exc:
        print(f"python -m tuning inspect: error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"what fold launches on {args.device} ({args.sms} SMs), compiled for sm_{args.arch}\n")
        print(static_report.HEADER)
    records = static_report.report(items, arch=args.arch, dump=args.dump, workers=args.workers,
                                   log=None if args.json else print)
    if args.json:
        print(json.dumps(records, indent=1))
    spilling = [r for r in records if r["spill_stores"] or r["spill_loads"]]
    for r in spilling:
        print(f"python -m tuning inspect: spills: {static_report.format_row(r)}", file=sys.stderr)
    return 1 if spilling else 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "show":
        return show(args.path)
    if args.command == "inspect":
        return inspect(args)

    import torch

    if args.command == "verify":
        from tuning.verify import verify

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            print("no GPU: set TRITON_INTERPRET=1 to verify in Triton's interpreter (slow; use --sample)")
            return 2
        checked, failures = verify(dtypes=tuple(args.dtype), device=device, sample=args.sample, seed=args.seed,
                                   budget_s=args.budget_s)
        print(f"verify: {checked} checks, {len(failures)} failures")
        return 1 if failures else 0

    from fold.config_lookup import SHIPPED_DIR
    from tuning.tune import drafter_classes, plan, tune

    out = args.out or Path(os.environ.get("FOLD_TUNING_DIR") or SHIPPED_DIR)
    classes = drafter_classes(args.drafters, args.dtype, [layout == "rotated" for layout in args.layout])
    if args.dry_run:
        total = 0
        for cls in classes:
            p = plan(cls, args.lengths, top_k=args.top_k)
            total += p["tiles"] + sum(p["buckets"].values())
            print(f"{cls}: {p['tiles']} tile configs, then per bucket at most:")
            for key, count in p["buckets"].items():
                print(f"  {key}: {count} configs")
        print(f"at most {total} timings in all; would write {out}")
        return 0
    path = tune(classes, args.lengths, out, top_k=args.top_k)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
