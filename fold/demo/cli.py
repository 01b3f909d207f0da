"""``fold-demo``: the paper's long-context comparison on the shipped tiny pair, on CPU, in minutes.

    fold-demo --quick                 # < 5 min on 2 cores: 2 lengths, dflash / window / fold / anchor-offset
    fold-demo                         # < 30 min: every policy, lengths 1K-16K, both tasks
    fold-demo --shift                 # Finding 1: the same drafter with its block moved far from its context

Tasks: ``code`` (held-out standard-library packages, concatenated repository-style) and
``retrieval`` (key-value documents ending with a key stored at least half the prompt earlier; the
target generates the 18-byte value, so tau there measures copying from far back).
For each task and length the target alone (AR) runs first, then every row: the DFlash drafter under
each context policy and the drafter trained with LongSpec's anchor-offset indices (read at true
positions). Every run is greedy and checked token for token against AR's output.

Prints a table of tau and CPU speedup (TPOT_AR / TPOT, both measured in this run) with 95%
bootstrap CIs over prompts; writes ``results.json``, ``table.txt`` and ``tau_vs_length.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

POLICIES = ("dflash", "window", "fold", "streaming", "yarn", "rerope", "infllm", "cmr")
ANCHOR_ROW = "anchor-offset"
PRESETS = {
    "quick": dict(lengths=[2048, 8192], prompts=4, new_tokens=48, rows=("dflash", "window", "fold", ANCHOR_ROW)),
    "default": dict(lengths=[1024, 2048, 4096, 8192, 16384], prompts=8, new_tokens=64,
                    rows=POLICIES + (ANCHOR_ROW,)),
}
SHIFTS = (0, 1024, 4096, 8192, 32768)
ANSWER_TOKENS = 18          # a retrieval answer: " " + two 8-hex words joined by a space


class PrefillMemo:
    """The target with its prompt forwards memoised (a fresh copy of the cache each time).

    Every row of a cell runs the same prompts, and the demo compares TPOT, which excludes the
    prefill, so computing it once per prompt changes no number and saves most of the run time.
    """

    def __init__(self, target):
        self.target, self.memo = target, {}

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, input_ids, cache=None, **kwargs):
        if cache is not None or not kwargs.get("use_cache"):
            return self.target(input_ids, cache=cache, **kwargs)
        key = (input_ids.numpy().tobytes(), tuple(sorted(kwargs.items())))
        if key not in self.memo:
            self.memo[key] = self.target(input_ids, **kwargs)
        out = self.memo[key]
        return type(out)(logits=out.logits, hidden_states=out.hidden_states,
                         past_key_values=copy.deepcopy(out.past_key_values))

    __call__ = forward


def load_pair(dtype=torch.float32):
    """The shipped target and both drafters, through transformers and ``spec.load_drafter``."""
    import transformers

    import fold.demo
    from fold import spec

    target = transformers.AutoModelForCausalLM.from_pretrained(fold.demo.TARGET_DIR, dtype=dtype).eval()
    return target, spec.load_drafter(fold.demo.DRAFTER_DIR, target), spec.load_drafter(fold.demo.ANCHOR_DRAFTER_DIR,
                                                                                        target)


def training_length(default: int = 1024) -> int:
    """The sequence length the shipped drafter was trained on (its config's ``fold_training``)."""
    import fold.demo

    config = json.loads((fold.demo.DRAFTER_DIR / "config.json").read_text())
    return int(config.get("fold_training", {}).get("seq_len", default))


def policy_options(policy: str, window: int, alpha: float, train_len: int) -> dict:
    """The paper's Appendix B.3 settings, scaled from W = 2048 to this window."""
    s = window / 2048
    return {
        "dflash": {},
        "window": dict(window=window),
        "fold": dict(window=window, alpha=alpha),
        "streaming": dict(sinks=4, recent=window - 4),
        "yarn": dict(reference_len=train_len),
        "rerope": dict(window=window, training_length=train_len),
        "infllm": dict(window=window, infllm_block=max(8, round(128 * s)), infllm_init=max(8, round(128 * s)),
                       infllm_topk=16, infllm_repr=4),
        "cmr": dict(cmr_chunk=32, cmr_top=max(1, window // 32), cmr_every=8),
    }[policy]


def prompts_for(task: str, length: int, count: int, seed: int, held) -> list[bytes]:
    from fold.demo import data

    rng = random.Random(f"{task}-{length}-{seed}")
    if task == "code":
        return [data.code_prompt(held, rng, length) for _ in range(count)]
    out = [data.retrieval_prompt(rng, length, length // 2) for _ in range(count)]
    width = min(map(len, out))
    return [p[len(p) - width:] for p in out]             # equal lengths: one unpadded batch


def shifted_read(rope, shift: int):
    """Every context entry at its true position, the block moved ``shift`` positions later (one softmax)."""
    from fold.rope import rotate

    def read(q, k, v, layer):
        _, n_q, heads_q, head_dim = q.shape
        n = k.shape[1] - n_q
        pos = torch.arange(k.shape[1], device=q.device) - n                 # relative to the block start
        pos[n:] += shift
        r = torch.arange(n_q, device=q.device) + shift
        ks = rotate(k[0].transpose(0, 1).float(), pos, rope)
        qs = rotate(q[0].transpose(0, 1).float(), r, rope)
        group = heads_q // k.shape[2]
        s = qs @ ks.repeat_interleave(group, 0).transpose(1, 2) * head_dim ** -0.5          # [Hq, n_q, L]
        o = torch.softmax(s, -1) @ v[0].transpose(0, 1).float().repeat_interleave(group, 0)
        return o.transpose(0, 1)[None].to(q.dtype)

    return read


def _mean_tpot(result) -> float:
    per_sequence = result.stats["per_sequence"]
    return sum(s["tpot_s"] for s in per_sequence) / len(per_sequence)


def _ci_record(task, length, name, taus, speedups, lossless, tpot, extra=None):
    from fold.spec.metrics import bootstrap_ci

    tau, tau_lo, tau_hi = bootstrap_ci([taus])
    sp, sp_lo, sp_hi = bootstrap_ci([speedups])
    return dict(task=task, length=length, policy=name, tau=round(tau, 4),
                tau_ci=[round(tau_lo, 4), round(tau_hi, 4)], speedup=round(sp, 4),
                speedup_ci=[round(sp_lo, 4), round(sp_hi, 4)], lossless=lossless, n_prompts=len(taus),
                tpot_ms=round(tpot * 1e3, 3), **(extra or {}))


def run_comparison(target, drafter, anchor, *, held, tasks, lengths, rows, prompts, new_tokens, window, alpha,
                   seed, bar=None, log=print) -> list[dict]:
    """``held``: {package: code} from :func:`fold.demo.data.held_out_code`."""
    from fold import spec
    from fold.spec.metrics import per_sequence_speedup, per_sequence_tau

    train_len = training_length()
    records = []
    target = PrefillMemo(target)
    for task in tasks:
        for length in lengths:
            target.memo.clear()
            ids = torch.tensor([list(p) for p in prompts_for(task, length, prompts, seed, held)])
            n_new = ANSWER_TOKENS if task == "retrieval" else new_tokens
            ar = spec.autoregressive(target, ids, max_new_tokens=n_new)
            records.append(_ci_record(task, ids.shape[1], "AR", [1.0] * len(ids), [1.0] * len(ids), True,
                                      _mean_tpot(ar)))
            for name in rows:
                model, policy = (anchor, "dflash") if name == ANCHOR_ROW else (drafter, name)
                opts = {} if name == ANCHOR_ROW else policy_options(policy, window, alpha, train_len)
                res = spec.generate(target, model, ids, max_new_tokens=n_new, policy=policy, **opts)
                lossless = torch.equal(res.sequences, ar.sequences)
                rec = _ci_record(task, ids.shape[1], name, per_sequence_tau(res), per_sequence_speedup(res, ar),
                                 lossless, _mean_tpot(res))
                records.append(rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{task} {length} {name} tau {rec['tau']:.2f}")
                if not lossless:
                    log(f"NOT LOSSLESS: {task} {length} {name} differs from AR")
    return records


def run_shift(target, drafter, anchor, *, held, prompts, new_tokens, seed, length=512, shifts=SHIFTS, bar=None):
    """Finding 1: tau of each drafter at ``length`` bytes with its block moved ``shift`` positions."""
    from fold import spec
    from fold.spec.metrics import per_sequence_speedup, per_sequence_tau

    target = PrefillMemo(target)
    ids = torch.tensor([list(p) for p in prompts_for("code", length, prompts, seed, held)])
    ar = spec.autoregressive(target, ids, max_new_tokens=new_tokens)
    records = []
    for label, model in (("dflash", drafter), (ANCHOR_ROW, anchor)):
        for shift in shifts:
            if shift == 0:
                res = spec.generate(target, model, ids, max_new_tokens=new_tokens, policy="dflash")
            else:                                       # the same loop with a custom read (spec.Read protocol)
                res = spec.generate(target, model, ids, max_new_tokens=new_tokens,
                                    policy=lambda request, s=shift: spec.Read(shifted_read(request["rope"], s),
                                                                              rope=request["rope"]))
            records.append(_ci_record("shift", ids.shape[1], label, per_sequence_tau(res),
                                      per_sequence_speedup(res, ar), torch.equal(res.sequences, ar.sequences),
                                      _mean_tpot(res), dict(shift=shift)))
            if bar is not None:
                bar.update(1)
    return records


def format_table(records: list[dict]) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in records):
        rs = [r for r in records if r["task"] == task]
        key = "shift" if task == "shift" else "length"
        cols = list(dict.fromkeys(r[key] for r in rs))
        names = list(dict.fromkeys(r["policy"] for r in rs))
        lines.append(f"\n{task}: tau [95% CI] / speedup over AR [95% CI], by {key}")
        lines.append(f"{'row':<14}" + "".join(f"{c:>32}" for c in cols))
        for name in names:
            cells = []
            for c in cols:
                r = next((r for r in rs if r["policy"] == name and r[key] == c), None)
                if r is None:
                    cells.append(f"{'-':>32}")
                    continue
                mark = "" if r["lossless"] else "!"             # "!": output differed from AR's
                tau = f"{r['tau']:5.2f} [{r['tau_ci'][0]:4.2f},{r['tau_ci'][1]:5.2f}]"
                speed = f"{r['speedup']:4.2f}x [{r['speedup_ci'][0]:4.2f},{r['speedup_ci'][1]:4.2f}]"
                cells.append(f"{tau} {speed}{mark}".rjust(32))
            lines.append(f"{name:<14}" + "".join(cells))
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in dict.fromkeys(r["task"] for r in records) if t != "shift"]
    if not tasks:
        return
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rs = [r for r in records if r["task"] == task and r["policy"] != "AR"]
        for name in dict.fromkeys(r["policy"] for r in rs):
            pts = sorted((r["length"], r["tau"], *r["tau_ci"]) for r in rs if r["policy"] == name)
            x = [p[0] for p in pts]
            style = dict(lw=2.5) if name == "fold" else dict(lw=1.2)
            ax.plot(x, [p[1] for p in pts], marker="o", label=name, **style)
            ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (bytes = tokens)")
        ax.set_ylabel("tau (tokens per round)")
        ax.set_title(f"{task}: acceptance length vs context length")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _int_at_least(minimum: int, why: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{why}, got {value}")
        return value
    return parse


def _alpha(text: str) -> float:
    from fold.attention import MAX_ALPHA

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 1.0 <= value <= MAX_ALPHA:
        raise argparse.ArgumentTypeError(f"must lie in [1, {MAX_ALPHA:g}], got {value}")
    return value


def check_writable(out: Path) -> None:
    """Create ``out`` and prove a file can be written there, before any work is done."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".fold-demo-probe-"):
        pass


def _write_atomically(path: Path, write) -> None:
    """``write(temporary path)``, then rename over ``path``: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_results(records: list[dict], out: Path) -> str:
    """Write the plot, ``table.txt`` and, last, ``results.json`` (each atomically), so a
    ``results.json`` always comes with the table and plot of the same records. Returns the table."""
    table = format_table(records)
    if any(r["task"] != "shift" for r in records):
        _write_atomically(out / "tau_vs_length.png", lambda p: plot(records, p))
    _write_atomically(out / "table.txt", lambda p: p.write_text(table + "\n"))
    _write_atomically(out / "results.json", lambda p: p.write_text(json.dumps(records, indent=1)))
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fold-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 lengths, 4 rows: under 5 minutes on 2 cores")
    ap.add_argument("--shift", action="store_true", help="run the Finding-1 diagnostic (block moved far away)")
    ap.add_argument("--out", type=Path, default=Path("fold-demo-out"))
    ap.add_argument("--lengths", type=_int_at_least(256), nargs="+",
                    help="context lengths in bytes, each >= 256 (default: preset)")
    ap.add_argument("--rows", nargs="+", choices=POLICIES + (ANCHOR_ROW,),
                    help="policies to compare (default: preset)")
    ap.add_argument("--tasks", nargs="+", choices=("code", "retrieval"), default=["code", "retrieval"])
    ap.add_argument("--prompts", type=_int_at_least(1), help="prompts per task and length (default: preset)")
    ap.add_argument("--new-tokens", type=_int_at_least(1), help="tokens generated per code prompt (default: preset)")
    ap.add_argument("--window", type=_int_at_least(8, " (StreamingLLM keeps 4 sinks and window - 4 recent entries)"),
                    default=256, help="FOLD's W (and Window's, ReRoPE's, StreamingLLM's)")
    ap.add_argument("--alpha", type=_alpha, default=2.0, help="FOLD's concentration factor, in [1, 1e4]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        check_writable(args.out)
    except OSError as exc:
        ap.error(f"--out {args.out} is not a writable folder: {exc}")

    preset = PRESETS["quick" if args.quick else "default"]
    lengths = args.lengths if args.lengths is not None else preset["lengths"]
    rows = tuple(args.rows if args.rows is not None else preset["rows"])
    prompts = args.prompts if args.prompts is not None else preset["prompts"]
    new_tokens = args.new_tokens if args.new_tokens is not None else preset["new_tokens"]
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    target, drafter, anchor = load_pair()
    from fold.demo import data

    held = data.held_out_code()
    total = len(args.tasks) * len(lengths) * len(rows) + (2 * len(SHIFTS) if args.shift else 0)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="fold-demo", unit="run", file=sys.stderr)
    log = bar.write if bar is not None else print
    records = run_comparison(target, drafter, anchor, held=held, tasks=args.tasks, lengths=lengths, rows=rows,
                             prompts=prompts, new_tokens=new_tokens, window=args.window, alpha=args.alpha,
                             seed=args.seed, bar=bar, log=log)
    table = save_results(records, args.out)                          # kept if the diagnostic fails
    if args.shift:
        records += run_shift(target, drafter, anchor, held=held, prompts=prompts, new_tokens=new_tokens,
                             seed=args.seed, bar=bar)
        table = save_results(records, args.out)
    if bar is not None:
        bar.close()
    print(table)
    runs = [r for r in records if r["policy"] != "AR"]
    bad = [r for r in runs if not r["lossless"]]
    print(f"\nW={args.window}, alpha={args.alpha}, {prompts} prompts per cell, {new_tokens} new tokens per code "
          f"prompt, {ANSWER_TOKENS} per retrieval prompt; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"lossless: {len(runs) - len(bad)}/{len(runs)} runs produced exactly the target's greedy output"
          + ("" if not bad else " -- FAILED: " + ", ".join(f"{r['task']}/{r['length']}/{r['policy']}" for r in bad)))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'tau_vs_length.png'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
