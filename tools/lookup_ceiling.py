"""What copying by content could give on a ``fold-demo --real`` run's prompts: a suffix lookup.

    python -m tools.lookup_ceiling OUT [OUT ...]          # --prompts, --seed, --window as the runs had

The retrieval and ``natural-*`` cells of the real pair end a few tokens into a span the context holds
far back, and the target goes on with that span (the answer). A drafter that copies by content
finds the far occurrence of the last few tokens and drafts what followed it. This tool plays such a
drafter on the very prompts a run measured, without a model: the prompts are drawn again from the
tokenizer and the seed (``fold.demo.experiment.prompts_for``; the target only chose which of them
were answered) and matched to the run's records by digest.

The lookup drafter, per round, takes the longest suffix of the committed tokens (at most 16) that
occurs in the part of the context it may read, the most recent such occurrence, and drafts the
``block - 1`` tokens that followed it; the answer accepts the matching prefix, and the target adds one
token, as in a speculative round. Three readers, split as FOLD splits the context: ``far`` reads only
occurrences whose next token lies more than ``W + block`` entries back (far from every row of the
block: FOLD's far memory, which the window row cannot see), ``window`` only the rest, ``all`` both
(what a FOLD row may read). For each cell this prints how many prompts a far lookup drafts in full in
its first round, and τ over the answer (committed tokens per round until the answer is done) of each
reader, with ``all − window`` (the lookup's fold − window), beside the run's own rows' fold − window
over its whole generation (the answer and the tokens after it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from tools.compare_runs import _cells, load

MAX_KEY = 16
READERS = ("far", "window", "all")


def lookup_draft(ids: Sequence[int], lo: int, hi: int, slots: int) -> list[int]:
    """The tokens a suffix lookup drafts after ``ids``: the longest suffix of ``ids`` (at most
    :data:`MAX_KEY` tokens) that also ends at some ``j`` with ``lo <= j < hi`` (``ids[j]`` the token
    after that occurrence), the largest such ``j``, and the ``slots`` tokens from ``ids[j]`` on (fewer
    where the sequence ends). Empty when not even the last token occurs there."""
    ids = list(ids)
    n = len(ids)
    for k in range(min(MAX_KEY, n - 1), 0, -1):
        key = ids[n - k:]
        for j in range(min(hi, n) - 1, max(lo, k) - 1, -1):
            if ids[j - k:j] == key:
                return ids[j:j + slots]
    return []


def lookup_rounds(prompt: Sequence[int], answer: Sequence[int], *, window: int, block: int,
                  reader: str) -> list[int]:
    """The tokens each speculative round commits while the target generates ``answer`` after
    ``prompt`` and a lookup drafter (:func:`lookup_draft`, ``block - 1`` slots) drafts: the accepted
    prefix plus the target's own token, the last round cut at the answer's end. ``reader``: ``"far"``
    looks up occurrences whose next token lies more than ``window + block`` back, ``"window"`` the
    others, ``"all"`` every one."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
    ids, done, rounds = list(prompt), 0, []
    while done < len(answer):
        edge = len(ids) - (window + block)           # entries before it are far from this round's block
        lo, hi = {"far": (0, edge), "window": (max(edge, 0), len(ids)), "all": (0, len(ids))}[reader]
        accepted = 0
        for token, want in zip(lookup_draft(ids, lo, hi, block - 1), answer[done:]):
            if token != want:
                break
            accepted += 1
        step = min(accepted + 1, len(answer) - done)
        ids += answer[done:done + step]
        done += step
        rounds.append(step)
    return rounds


def ceiling(records: list[dict], tokenizer, held_text, *, prompts: int, seed: int, window: int,
            block: int) -> list[dict]:
    """Per cell of ``records`` (a run's ``results.json``): the lookup readers on its measured prompts."""
    from fold.demo import experiment

    out = []
    for (task, length), rows in sorted(_cells(records).items()):
        if not task.startswith(("retrieval-", "natural-")):
            continue
        measured = rows.get("window", next(iter(rows.values())))["prompts"]
        ids, _, answers = experiment.prompts_for(task, length, prompts * experiment.RETRIEVAL_DRAWS, seed, None,
                                                 tokenizer, 1, held_text)
        found = {experiment.prompt_digest(ids[i]): i for i in range(ids.shape[0])}
        missing = [d for d in measured if d not in found]
        if missing:
            raise ValueError(f"{task} {length}: {len(missing)} of the run's {len(measured)} prompts are not among "
                             f"the prompts drawn with --prompts {prompts} --seed {seed} (pass the run's values)")
        rec = dict(task=task, length=length, n=len(measured))
        first, tau = [], {reader: [] for reader in READERS}
        for digest in measured:
            i = found[digest]
            prompt = ids[i].tolist()
            for reader in tau:
                rounds = lookup_rounds(prompt, answers[i], window=window, block=block, reader=reader)
                tau[reader].append(sum(rounds) / len(rounds))
                if reader == "far":
                    first.append(rounds[0] >= min(block, len(answers[i])))
        rec["far_full_first_round"] = sum(first)
        for reader, values in tau.items():
            rec[f"tau_{reader}"] = round(statistics.fmean(values), 2)
        rec["all_minus_window"] = round(statistics.fmean(a - w for a, w in zip(tau["all"], tau["window"])), 2)
        if "tau_minus_window" in rows.get("fold", {}):
            rec["run_fold_minus_window"] = round(rows["fold"]["tau_minus_window"], 2)
        out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.lookup_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="fold-demo --real --out folders (or their results.json)")
    ap.add_argument("--prompts", type=int, default=6, help="the runs' --prompts (default 6)")
    ap.add_argument("--seed", type=int, default=0, help="the runs' --seed (default 0)")
    ap.add_argument("--window", type=int, default=256, help="W, the runs' --window (default 256)")
    ap.add_argument("--block", type=int, default=8, help="the drafter's block size (default 8, the real drafter's)")
    ap.add_argument("--tokenizer", type=Path, help="the target's tokenizer (default: the real target's directory)")
    args = ap.parse_args(argv)
    for name in ("prompts", "window", "block"):
        if getattr(args, name) < 1 + (name == "block"):
            ap.error(f"--{name} must be at least {1 + (name == 'block')}")
    import transformers

    from fold.demo import corpus, real

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer or real.target_dir())
    held_text = corpus.held_out_code()
    print(f"{'task':<18} {'length':>6} {'n':>3} {'far: all drafted in round 1':>28} {'τ answer: far':>14} "
          f"{'window':>7} {'all':>5} {'all − window':>13} {'run: fold − window':>19}")
    for run in args.runs:
        try:
            rows = ceiling(load(run), tokenizer, held_text, prompts=args.prompts, seed=args.seed,
                           window=args.window, block=args.block)
        except ValueError as e:
            print(f"{run}: {e}", file=sys.stderr)
            return 2
        for r in rows:
            print(f"{r['task']:<18} {r['length']:>6} {r['n']:>3} {r['far_full_first_round']:>28} {r['tau_far']:>14.2f} "
                  f"{r['tau_window']:>7.2f} {r['tau_all']:>5.2f} {r['all_minus_window']:>+13.2f} "
                  f"{r.get('run_fold_minus_window', float('nan')):>+19.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
