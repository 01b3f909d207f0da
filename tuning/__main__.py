"""``python -m tuning tune|show|verify``: tune the Triton kernels for this GPU and ship the result.

    python -m tuning tune --dry-run                 # what would be timed (works on a CPU)
    python -m tuning tune                           # sweep, write fold/configs/<device>.json
    python -m tuning tune --out $FOLD_TUNING_DIR    # or a folder fold reads at runtime
    python -m tuning show fold/configs/NVIDIA_H200.json
    python -m tuning verify --sample 20             # configs vs the reference (interpreter on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def _classes(args):
    from tuning.tune import ShapeClass
    from tuning.workloads import DRAFTERS

    seen, classes = set(), []
    for name in args.drafters:
        shape = DRAFTERS[name]
        for dtype in args.dtype:
            for layout in args.layout:
                cls = ShapeClass(head_dim=shape.head_dim, group=shape.heads_q // shape.heads_kv, n_q=shape.n_q,
                                 dtype=dtype, keys_rotated=layout == "rotated", heads_kv=shape.heads_kv,
                                 window=shape.window)
                if cls.key(1024) not in seen:          # n_q 7 and 8 share a padded class
                    seen.add(cls.key(1024))
                    classes.append(cls)
    return classes


def main(argv=None) -> int:
    from fold.config_lookup import SHIPPED_DIR
    from tuning.tune import BUCKETS
    from tuning.workloads import DRAFTERS

    parser = argparse.ArgumentParser(prog="python -m tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_tune = sub.add_parser("tune", help="sweep the config space and write the JSON cache")
    p_tune.add_argument("--drafters", nargs="+", choices=sorted(DRAFTERS), default=sorted(DRAFTERS))
    p_tune.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    p_tune.add_argument("--layout", nargs="+", default=["unrotated", "rotated"], choices=["unrotated", "rotated"])
    p_tune.add_argument("--lengths", nargs="+", type=int, default=list(BUCKETS))
    p_tune.add_argument("--top-k", type=int, default=3)
    p_tune.add_argument("--out", type=Path, default=Path(os.environ.get("FOLD_TUNING_DIR") or SHIPPED_DIR))
    p_tune.add_argument("--dry-run", action="store_true", help="list the sweep without timing")
    p_show = sub.add_parser("show", help="print a cache file")
    p_show.add_argument("path", type=Path)
    p_verify = sub.add_parser("verify", help="run configs of the space against the reference")
    p_verify.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"])
    p_verify.add_argument("--sample", type=int, default=None, help="check this many random configs")
    p_verify.add_argument("--seed", type=int, default=0)
    p_verify.add_argument("--budget-s", type=float, default=None)
    args = parser.parse_args(argv)

    if args.command == "show":
        data = json.loads(args.path.read_text())
        for k, v in data["_metadata"].items():
            print(f"{k:>12}: {v}")
        print(f"\n{'shape class':<44} {'bm':>4} {'bn':>4} {'splits':>6} {'warps':>5} {'stages':>6} {'us':>9} {'default us':>10}")
        for key, e in data["entries"].items():
            c = e["config"]
            print(f"{key:<44} {c['block_m']:>4} {c['block_n']:>4} {c['num_splits']:>6} {c['num_warps']:>5} "
                  f"{c['num_stages']:>6} {e['us']:>9.1f} {e['heuristic_us']:>10.1f}")
        return 0

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

    from tuning.tune import plan, tune

    classes = _classes(args)
    if args.dry_run:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        total = 0
        for cls in classes:
            p = plan(cls, args.lengths, device, top_k=args.top_k)
            n = p["tiles"] + sum(p["buckets"].values())
            total += n
            print(f"{cls}: {p['tiles']} tile configs, then per bucket:")
            for key, count in p["buckets"].items():
                print(f"  {key}: {count} configs")
        print(f"{total} timings in all; would write {args.out}")
        return 0
    path = tune(classes, args.lengths, args.out, top_k=args.top_k)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
