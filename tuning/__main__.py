"""``python -m tuning tune|show``: tune the Triton kernels for this GPU and ship the result.

    python -m tuning tune --dry-run                 # what would be timed (works on a CPU)
    python -m tuning tune                           # sweep, write fold/configs/<device>.json
    python -m tuning tune --out $FOLD_TUNING_DIR    # or a folder fold reads at runtime
    python -m tuning show fold/configs/NVIDIA_H200.json

The checks of what it may pick live in ``tools/``: ``python -m tools.verify_configs`` (every config of
the space against the reference) and ``python -m tools.static_report`` (registers, spills and shared
memory on sm_90, no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fold.argtypes import positive

DTYPES = ("bfloat16", "float16", "float32")


def parser() -> argparse.ArgumentParser:
    from benchmarks.workloads import DRAFTERS

    buckets = [2**i for i in range(10, 19)]
    parser = argparse.ArgumentParser(prog="python -m tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_tune = sub.add_parser("tune", help="sweep the config space and write the JSON cache")
    p_tune.add_argument("--drafters", nargs="+", choices=sorted(DRAFTERS), default=sorted(DRAFTERS))
    p_tune.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=DTYPES)
    p_tune.add_argument("--layout", nargs="+", default=["unrotated", "rotated"], choices=["unrotated", "rotated"])
    p_tune.add_argument("--lengths", nargs="+", type=positive(int), default=buckets)
    p_tune.add_argument("--top-k", type=positive(int), default=3)
    p_tune.add_argument("--out", type=Path, default=None,
                        help="folder of the cache (default: $FOLD_TUNING_DIR, else fold/configs)")
    p_tune.add_argument("--dry-run", action="store_true", help="list the sweep without timing")
    p_show = sub.add_parser("show", help="print a cache file")
    p_show.add_argument("path", type=Path)
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


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "show":
        return show(args.path)

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
