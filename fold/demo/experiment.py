"""The demo's experiment: the pairs, the prompts, the rows, their records and the comparison.

``fold-demo`` (:mod:`fold.demo.cli`) is the command line over it; benchmarks and tests use it
directly. In order of use:

- pairs: :func:`load_pair` (the shipped toy pair, or a trained one under ``artifacts``),
  :func:`load_real_pair` (SmolLM2-135M-Instruct and its drafter), :func:`training_length`;
- prompts: :func:`prompts_for` (a task's prompts at one length: ``code``, ``retrieval`` and the
  held-out ``retrieval-<form>`` tasks, :data:`HELD_OUT_TASKS`);
- rows: :class:`Row`, :func:`make_rows` (AR and one row per context policy, :func:`policy_options`),
  :func:`measure_cell` (every row on the same prompts, interleaved, checked against AR);
- records: :func:`cell_records` (tau, speedup and paired differences with 95% bootstrap CIs);
- the comparison: :func:`run_comparison` (every task and length) and :func:`run_shift` (Finding 1).
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from pathlib import Path

import torch

from fold.demo import corpus, natural
from fold.demo.prompts import HELD_OUT_FORMS, code_prompt, planted_retrieval_prompt, retrieval_prompt, retrieved

POLICIES = ("dflash", "window", "fold", "streaming", "yarn", "rerope", "infllm", "cmr")
ANCHOR_ROW = "anchor-offset"
BUDGET_ROW = "fold-budget"            # fold with far_budget / far_page: the far read bounded per round
ROWS = POLICIES + (BUDGET_ROW, ANCHOR_ROW)
FAR_BUDGET, FAR_PAGE = 1024, 64
TASKS = ("code", "retrieval")
HELD_OUT_TASKS = tuple(f"retrieval-{form}" for form in HELD_OUT_FORMS)     # --real only
NATURAL_TASKS = tuple(f"natural-{form}" for form in natural.DEV_FORMS)     # --real only: the development forms
REAL_TASKS = TASKS + HELD_OUT_TASKS + NATURAL_TASKS
SCOPES = {"retrieval": "in the drafter's training format (planted SECRET line)",
          **{t: "held out from the drafter's training (form and lexicon)" for t in HELD_OUT_TASKS},
          **{t: f"a development form, never trained on ({natural.DEV_SOURCES[t.removeprefix('natural-')]}): "
                "cut where the text repeats a span found only >= 1/4 of the prompt back" for t in NATURAL_TASKS}}
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
    code with one planted ``SECRET_... = "value"`` line (:func:`fold.demo.prompts.planted_retrieval_prompt`);
    ``retrieval-<form>``, a held-out form of :data:`fold.demo.prompts.HELD_OUT_FORMS` whose filler is the prose
    of ``held_text``; ``natural-<form>``, a development form of :data:`fold.demo.natural.DEV_FORMS` cut at far
    repeats at least ``length // 4`` tokens back (:func:`fold.demo.natural.far_repeat_prompts`), the answer
    how the repeat goes on. ``answers``: each retrieval prompt's stored value as token ids (None for code)."""
    rng = random.Random(f"{task}-{length}-{seed}")
    if task in NATURAL_TASKS:
        ids = natural.dev_ids(task.removeprefix("natural-"), tokenizer)
        pairs = natural.far_repeat_prompts(rng, ids, length, count, length // 4)
        return torch.tensor([p for p, _ in pairs]), max(new_tokens, natural.ANSWER), [a for _, a in pairs]
    if task == "code":
        newlines = [i for t, i in tokenizer.get_vocab().items() if t.startswith("Ċ")]        # byte-level "\n..."
        ids = torch.tensor([code_prompt(held_ids, rng, length, newlines) for _ in range(count)])
        return ids, new_tokens, None
    if task in HELD_OUT_TASKS:
        if held_text is None:
            raise ValueError(f"task {task!r} needs held_text (the held-out packages' source, for its prose)")
        prose = corpus.prose_paragraphs("".join(held_text[name] for name in sorted(held_text)))
        make = HELD_OUT_FORMS[task.removeprefix("retrieval-")]
        pairs = [make(rng, tokenizer, prose, length, length // 2) for _ in range(count)]
    elif task != "retrieval":
        raise ValueError(f"unknown task {task!r}; expected one of {REAL_TASKS}")
    elif held_text is not None:
        pairs = [planted_retrieval_prompt(rng, tokenizer, held_text, length, length // 2) for _ in range(count)]
    else:
        pairs = [retrieval_prompt(rng, tokenizer, length, length // 2) for _ in range(count)]
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
        self.prompts: list[str] = []                 # a digest of each measured prompt's token ids
        self.tpots: list[list[float]] = []           # per prompt, one TPOT per repeat
        self.lossless = True


def prompt_digest(prompt: torch.Tensor) -> str:
    """A short name of a prompt's token ids (``[1, n]``), so two runs can be paired prompt by prompt."""
    return hashlib.sha1(prompt.reshape(-1).to(torch.int64).numpy().tobytes()).hexdigest()[:12]


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
            if not retrieved(first.sequences[0, prompt.shape[1]:].tolist(), answers[p]):
                if bar is not None:                     # not a retrieval for this target: the next prompt
                    bar.total += 1
                    bar.update(1)
                continue
        kept += 1
        reference, digest = None, prompt_digest(prompt)
        for row in rows:
            row.tpots.append([])
            row.prompts.append(digest)
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
    prompts): τ, τ − Window and τ − FOLD paired with 95% bootstrap CIs, the speedup over AR. A row
    ``POLICY@NAME`` (another drafter's, :func:`make_rows`'s ``versus``) is paired with ``window@NAME``
    and ``fold@NAME``."""
    ar = next(r for r in rows if r.name == "AR")
    ar_tpot = [statistics.median(t) for t in ar.tpots]
    by_name = {r.name: r for r in rows}
    records = []
    for row in rows:
        base, at, label = row.name.partition("@")
        window, full_fold = by_name.get("window" + at + label), by_name.get("fold" + at + label)
        tpot = [statistics.median(t) for t in row.tpots]
        tau, tau_ci = _ci(row.taus)
        speedup, speedup_ci = _ci([a / b for a, b in zip(ar_tpot, tpot)])
        rec = dict(task=task, length=length, policy=row.name, tau=tau, tau_ci=tau_ci, speedup=speedup,
                   speedup_ci=speedup_ci, lossless=row.lossless, n_prompts=len(row.taus),
                   repeats=len(row.tpots[0]), tpot_ms=round(statistics.mean(tpot) * 1e3, 3),
                   taus=[round(t, 4) for t in row.taus], tpot_ms_per_prompt=[round(t * 1e3, 3) for t in tpot],
                   prompts=list(row.prompts))
        if window is not None and base not in ("AR", "window"):
            rec["tau_minus_window"], rec["tau_minus_window_ci"] = _ci(
                [a - b for a, b in zip(row.taus, window.taus)])
        if full_fold is not None and base == BUDGET_ROW:             # what the budget costs FOLD, paired
            rec["tau_minus_fold"], rec["tau_minus_fold_ci"] = _ci([a - b for a, b in zip(row.taus, full_fold.taus)])
        records.append(rec)
    return records


def make_rows(target, drafter, anchor, names, window: int, alpha: float, train_len: int,
              draft_cutoff: float = 0.0, prefill=None, far_budget: int = FAR_BUDGET,
              far_page: int = FAR_PAGE, far_rank: str = "bound", policies: dict | None = None,
              versus: dict | None = None) -> list[Row]:
    """AR, then one row per policy name (``draft_cutoff``: :func:`fold.spec_decode.generate`'s, every drafter
    row; ``prefill``: a :class:`fold.spec_decode.Prefills` the rows share, so each prompt is run once;
    ``far_budget``, ``far_page``, ``far_rank``: the ``fold-budget`` row's; ``policies``: {row name: a
    ``policy(request) -> Read``} run for that row instead of its own read, the hook through which a
    script watches or replaces a row's read, :class:`fold.spec_decode.Read`; ``versus``: {name: another
    drafter}, whose rows ``POLICY@name`` follow, every policy but the anchor-offset row, on the same
    prompts and prefills)."""
    from fold import spec_decode

    def ar(prompt, n_new):
        return spec_decode.autoregressive(target, prompt, max_new_tokens=n_new, prefill=prefill)

    rows = [Row("AR", ar)]
    for suffix, model_of_rows in [("", drafter)] + [(f"@{label}", other) for label, other in (versus or {}).items()]:
        for name in names:
            if suffix and name == ANCHOR_ROW:
                continue
            model, policy = ((anchor, "dflash") if name == ANCHOR_ROW
                             else (model_of_rows, "fold" if name == BUDGET_ROW else name))
            opts = ({} if name == ANCHOR_ROW
                    else policy_options(name, window, alpha, train_len, far_budget, far_page, far_rank))
            if policies and name in policies:
                policy, opts = policies[name], {}

            def run(prompt, n_new, model=model, policy=policy, opts=opts):
                return spec_decode.generate(target, model, prompt, max_new_tokens=n_new, policy=policy,
                                            draft_cutoff=draft_cutoff, prefill=prefill, **opts)
            rows.append(Row(name + suffix, run))
    return rows


def warm_up(rows: list[Row], ids: torch.Tensor) -> None:
    """One short untimed run per row (first-call allocations and lazy initialisation)."""
    for row in rows:
        row.run(ids[:1, -256:], 4)


def run_comparison(target, drafter, anchor, tokenizer, *, held_ids, tasks, lengths, rows, prompts, new_tokens,
                   repeats, window, alpha, seed, train_len, bar=None, log=print, last_logits_only=False,
                   held_text=None, draft_cutoff: float = 0.0, every_prompt: bool = False,
                   far_budget: int = FAR_BUDGET, far_page: int = FAR_PAGE, far_rank: str = "bound",
                   policies: dict | None = None, versus: dict | None = None, on_cell=None) -> list[dict]:
    """``held_ids``: {package: token ids} of :func:`fold.demo.corpus.held_out_code`; ``held_text``: see
    :func:`prompts_for` (the real pair's: its retrieval cells keep the first ``prompts`` prompts whose
    value the target retrieves, of up to ``RETRIEVAL_DRAWS`` times as many drawn, and their records carry
    ``prompts_drawn``, ``prompts_answered`` and ``scope``, :data:`SCOPES`; ``every_prompt``: the first
    ``prompts`` drawn, retrieved or not); ``policies``, ``versus``: :func:`make_rows`'s; ``on_cell``: called
with the records so far after each cell (a long run saves as it goes).
    Every row of a cell runs the same prompts and TPOT excludes the prefill, so each prompt is run
    once (:class:`fold.spec_decode.Prefills`); ``last_logits_only`` (a real target: a 7K prompt's full logits
    are 1.4 GB and the loop reads the last row) keeps one prompt at a time."""
    from fold import spec_decode

    records = []
    warmed = False
    for task in tasks:
        for length in lengths:
            answered = task != "code" and (held_text is not None or task in NATURAL_TASKS) and not every_prompt
            ids, n_new, answers = prompts_for(task, length, prompts * (RETRIEVAL_DRAWS if answered else 1), seed,
                                              held_ids, tokenizer, new_tokens, held_text)
            shared = spec_decode.Prefills(target, keep=1 if last_logits_only else None, last_logits_only=last_logits_only)
            cell = make_rows(target, drafter, anchor, rows, window, alpha, train_len, draft_cutoff, shared,
                             far_budget, far_page, far_rank, policies, versus)
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
                if (held_text is not None or task in NATURAL_TASKS) and task in SCOPES:
                    rec["scope"] = SCOPES[task]
            records += recs
            if on_cell is not None:
                on_cell(records)
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
