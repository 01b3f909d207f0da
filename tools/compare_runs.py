"""Two drafters' ``fold-demo`` rows compared prompt by prompt.

    python -m tools.compare_runs A B              # two runs of the same command, two --drafter
    python -m tools.compare_runs OUT --versus B   # one run with --versus DIR/B: its rows POLICY@B against POLICY

``A`` and ``B`` are ``fold-demo --out`` folders (or their ``results.json``): the prompts are chosen by the
target alone, so both runs measure the same prompts, and each record names them (``prompts``: a digest
of each prompt's token ids). ``fold-demo --real --versus DIR`` runs another drafter's rows in the same
run, on the same prompts and prefills (each prompt's prefill, the costly part, once). For every
task, length and policy both runs hold, this prints τ of each, the paired difference B − A of τ
with its 95% bootstrap CI over prompts, and the same of τ − Window (what the policy adds over the
window read, B's minus A's). Per task it also gives the mean over its lengths (prompts resampled
within each length). Cells whose prompts differ are refused: they cannot be paired.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fold.spec_decode.metrics import bootstrap_ci


def load(path: str | Path) -> list[dict]:
    """The records of a ``fold-demo`` run: ``path`` is its ``--out`` folder or its ``results.json``."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise ValueError(f"no fold-demo results at {path} (expected an --out folder holding results.json)")
    records = json.loads(path.read_text())
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path} is not a fold-demo results.json (a list of records)")
    return records


def split_versus(records: list[dict], name: str) -> tuple[list[dict], list[dict]]:
    """A run with another drafter's rows (``fold-demo --versus``): the first drafter's records, and
    drafter ``name``'s (its rows ``POLICY@name``) named as the first's."""
    suffix = "@" + name
    mine = [r for r in records if "@" not in r["policy"]]
    theirs = [dict(r, policy=r["policy"][:-len(suffix)]) for r in records if r["policy"].endswith(suffix)]
    if not theirs:
        found = sorted({r["policy"].partition("@")[2] for r in records if "@" in r["policy"]})
        raise ValueError(f"the run holds no rows of drafter {name!r} (POLICY@{name}); it holds {found or 'none'}")
    return mine, theirs


def _cells(records: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for rec in records:
        if rec.get("task") == "shift" or "taus" not in rec:
            continue
        cells.setdefault((rec["task"], rec["length"]), {})[rec["policy"]] = rec
    return cells


def _paired(cell_a: dict[str, dict], cell_b: dict[str, dict], policy: str, name: str) -> list[float] | None:
    """Per prompt, B's value minus A's: ``name`` is ``tau`` or ``minus_window`` (τ − Window)."""
    def values(cell):
        taus = cell[policy]["taus"]
        if name == "tau":
            return taus
        if "window" not in cell or policy in ("AR", "window"):
            return None
        return [t - w for t, w in zip(taus, cell["window"]["taus"])]

    a, b = values(cell_a), values(cell_b)
    return None if a is None or b is None else [y - x for x, y in zip(a, b)]


def compare(records_a: list[dict], records_b: list[dict]) -> list[dict]:
    """One row per (task, length, policy) both runs hold (AR left out), and one per (task, policy)
    over the task's lengths (``length`` None). Each row: ``n`` prompts, ``tau_a``, ``tau_b``,
    ``delta_tau`` and ``delta_tau_ci`` (B − A, paired by prompt), and where both runs have a Window row
    ``delta_minus_window`` and its CI (B's τ − Window minus A's). Raises ``ValueError`` where a cell's
    prompts differ between the runs (or a record carries no prompt digests)."""
    cells_a, cells_b = _cells(records_a), _cells(records_b)
    rows, per_task = [], {}
    for key in sorted(set(cells_a) & set(cells_b)):
        cell_a, cell_b = cells_a[key], cells_b[key]
        for policy in [p for p in cell_a if p in cell_b and p != "AR"]:
            pa, pb = cell_a[policy].get("prompts"), cell_b[policy].get("prompts")
            if not pa or pa != pb:
                raise ValueError(f"{key[0]} {key[1]} {policy}: the two runs measured different prompts "
                                 f"({pa} vs {pb}); only runs of the same command can be paired")
            row = dict(task=key[0], length=key[1], policy=policy, n=len(pa),
                       tau_a=cell_a[policy]["tau"], tau_b=cell_b[policy]["tau"])
            for name in ("tau", "minus_window"):
                diffs = _paired(cell_a, cell_b, policy, name)
                if diffs is None:
                    continue
                mean, lo, hi = bootstrap_ci([diffs])
                row[f"delta_{name}"], row[f"delta_{name}_ci"] = round(mean, 4), [round(lo, 4), round(hi, 4)]
                per_task.setdefault((key[0], policy, name), []).append(diffs)
            rows.append(row)
    for (task, policy, name), groups in sorted(per_task.items()):
        mean, lo, hi = bootstrap_ci(groups)
        summary = next((r for r in rows if r["task"] == task and r["policy"] == policy and r["length"] is None), None)
        if summary is None:
            summary = dict(task=task, length=None, policy=policy, n=sum(len(g) for g in groups))
            rows.append(summary)
        summary[f"delta_{name}"], summary[f"delta_{name}_ci"] = round(mean, 4), [round(lo, 4), round(hi, 4)]
    return rows


def format_rows(rows: list[dict]) -> str:
    """The comparison as a table (B − A; an interval above 0 means B is better on those prompts)."""
    def ci(row, name):
        if f"delta_{name}" not in row:
            return "-"
        lo, hi = row[f"delta_{name}_ci"]
        return f"{row[f'delta_{name}']:+.2f} [{lo:+.2f}, {hi:+.2f}]"

    lines = [f"{'task':<18}{'length':>8}  {'policy':<12}{'n':>3}  {'tau A':>6}  {'tau B':>6}  "
             f"{'tau B-A [95% CI]':<24}{'(tau-window) B-A [95% CI]':<26}"]
    for row in rows:
        length = "all" if row["length"] is None else str(row["length"])
        tau_a = f"{row['tau_a']:6.2f}" if "tau_a" in row else f"{'':6}"
        tau_b = f"{row['tau_b']:6.2f}" if "tau_b" in row else f"{'':6}"
        lines.append(f"{row['task']:<18}{length:>8}  {row['policy']:<12}{row['n']:>3}  {tau_a}  {tau_b}  "
                     f"{ci(row, 'tau'):<24}{ci(row, 'minus_window'):<26}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.compare_runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="the baseline run: a fold-demo --out folder or its results.json")
    parser.add_argument("b", nargs="?", help="the run compared with it, of the same command")
    parser.add_argument("--versus", metavar="NAME", help="instead of B: A's rows POLICY@NAME (fold-demo --versus)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if (args.b is None) == (args.versus is None):
        parser.error("give either a second run B or --versus NAME")
    try:
        records_a, records_b = ((load(args.a), load(args.b)) if args.b is not None
                                else split_versus(load(args.a), args.versus))
        rows = compare(records_a, records_b)
    except ValueError as err:
        parser.error(str(err))
    if not rows:
        parser.error("the two runs share no cell (task, length and policy)")
    b = args.b if args.b is not None else f"{args.a}, the rows of drafter {args.versus}"
    print(f"A = {args.a}\nB = {b}\n" + format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
