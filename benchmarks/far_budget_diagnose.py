"""Where FOLD's far mass lies against the pages a far budget reads, and what other page rules would give.

A research script for issue 31's missed acceptance goal (toy retrieval), not part of the library.
It runs the toy pair's FOLD drafter on retrieval prompts and, at every draft round, reads the drafter's
attention inputs and computes in float64, per rule:

- ``recall``: the share of FOLD's far mass (``softmax(alpha * logits)`` over the far entries, averaged
  over rows and query heads) in the pages read;
- ``err``: ``|o_rule - o_fold| / |o_fold - o_window|``, the output's distance from full FOLD as a
  share of what the far memory changes at all.

Rules (each reads the pages a block straddles, then the best ``budget // page - #straddlers`` others,
per KV head). Page scores from the page's keys' summary, as the library could keep them:
``bound`` (the library's rule: the box bound, max over rows and the group's heads), ``mean`` (the mean
key's logit), ``pcabox<C>`` (the box in the principal basis of the first C far keys), ``moment`` (a
Gaussian estimate of the page's mass from the keys' mean and variance). From every key, at reduced
precision: ``q<b>`` (each key quantized to b bits a dimension inside its page's box), ``sparq<r>``
(logits from the r largest query components, SparQ's estimate). Oracles (every key exact): ``exact``
(each page's largest far logit), ``mass`` (each page's share of the far mass). Suffixes: ``-norm``
turns a score into each page's share per row and head (softmax over pages) before averaging over rows
and heads, instead of the maximum; ``-vote`` counts each row's and head's top 16; ``r1`` scores with
the block's mean query alone; ``+rest`` adds, for every page not read, one surrogate entry (the page's
mean key and mean value, weight ``P``, plus the Gaussian variance term for ``moment`` / ``mass``).
``--check`` compares this script's dense read with ``fold.attention`` (full, and ``bound``).
``--list-recall`` measures the library's own selection (``fold.far_pages.select_pages``, both ranks)
with the list of groups ranked page by page at its size (``max(2K, 16)`` groups), at half that
(``max(K, 8)``) and at every group: the recall of FOLD's far mass in the pages read.

``--tau RULE`` instead measures tau on the demo's retrieval cells with the fold-budget row's read
replaced by RULE (computed densely here; lossless is checked as in fold-demo). With ``--real`` it runs
``fold-demo --real``'s cells instead (the real pair, W = 256, the same prompts: the planted ``retrieval``
task's first prompts whose value the target retrieves) and prints each prompt's tau for full FOLD and
for RULE.

    OMP_NUM_THREADS=1 python -m benchmarks.far_budget_diagnose --lengths 4096 8192 --prompts 3
    OMP_NUM_THREADS=1 python -m benchmarks.far_budget_diagnose --tau exact --lengths 8192
    OMP_NUM_THREADS=1 python -m benchmarks.far_budget_diagnose --real --tau mass --lengths 8128 --prompts 6
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from reference.rope import apply_rope

RULES = ("bound", "exact", "mass", "bound+rest", "exact+rest", "mean", "mean+rest", "sample+rest", "moment",
         "moment+rest", "mass+rest", "sparq4", "sparq8", "sparq16", "pca4", "pca8", "pca16", "bound-norm", "exact-norm",
         "bound-vote", "exact-vote", "pcabox-norm", "pcabox512-norm", "mean-norm", "half-norm",
         "q1-norm", "q2-norm", "q4-norm", "exact1-norm", "q2r1-norm", "q1r1-norm", "q4r1-norm")


def dense_states(q, k, v, *, window, rope, alpha):
    """One sequence's drafter read, float64: q [n_q, Hq, d] pre-RoPE, k, v [L, Hkv, d] pre-RoPE ->
    the pieces every rule needs (logits, masks, values per query head)."""
    n_q, heads_q, d = q.shape
    L, heads_kv = k.shape[:2]
    group = heads_q // heads_kv
    n = L - n_q
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    inv = rope.inv_freq.to(q.device)
    qb, kb = q.double(), k.double().repeat_interleave(group, dim=1)
    vb = v.double().repeat_interleave(group, dim=1)
    j, r = torch.arange(L), torch.arange(n_q)
    D = window + n_q
    s = d ** -0.5
    s_win = torch.einsum("rhd,jhd->hrj", apply_rope(qb, (n + r)[:, None], inv, **rot),
                         apply_rope(kb, j[:, None], inv, **rot)) * s
    k_far = apply_rope(kb, torch.zeros_like(j)[:, None], inv, **rot)
    s_far = torch.einsum("rhd,jhd->hrj", apply_rope(qb, (D + r)[:, None], inv, **rot), k_far) * s * alpha
    in_win = ((n + r)[:, None] - j[None, :]) < D                                  # [n_q, L]
    return dict(s_win=s_win, s_far=s_far, in_win=in_win, v=vb, k_far=k_far, n=n, D=D, group=group, scale=s)


def _with_far_queries(st, q, rope, alpha):
    """Add ``q_far [n_q, Hq, d]``: the block's queries at FOLD's far position, times scale and alpha."""
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    n_q = q.shape[0]
    st["q_far"] = apply_rope(q.double(), (st["D"] + torch.arange(n_q))[:, None], rope.inv_freq, **rot) \
        * st["scale"] * alpha


def combine(st, far_read, alpha, extra=None):
    """Output [n_q, Hq, d] from the window branch and the far entries ``far_read [Hq, n_q, L]``; ``extra``
    = (logits [Hq, n_q, E] already times alpha, values [Hq, E, d]) surrogate entries added to the far branch."""
    ninf = torch.tensor(float("-inf"), dtype=torch.float64)
    sw = torch.where(st["in_win"], st["s_win"], ninf)
    lse_n = torch.logsumexp(sw, -1)
    o_n = torch.einsum("hrj,jhd->hrd", torch.softmax(sw, -1), st["v"])
    sf = torch.where(far_read & ~st["in_win"], st["s_far"], ninf)
    vals = st["v"].transpose(0, 1)                                                # [Hq, L, d]
    if extra is not None:
        sf = torch.cat([sf, extra[0]], -1)
        vals = torch.cat([vals, extra[1]], 1)
    lse_f = torch.logsumexp(sf, -1)
    o_f = torch.einsum("hrj,hjd->hrd", torch.softmax(sf, -1).nan_to_num(0.0), vals)
    lf = lse_f / alpha
    m = torch.maximum(lse_n, lf)
    wn, wf = torch.exp(lse_n - m), torch.exp(lf - m)
    wf = torch.where(torch.isfinite(lf), wf, 0.0)
    return ((wn[..., None] * o_n + wf[..., None] * o_f) / (wn + wf)[..., None]).transpose(0, 1)


def page_scores(st, rule, page, bounds_q=None):
    """[Hkv, pages] score of each page for ``rule`` (higher = read first)."""
    heads_q, n_q, L = st["s_far"].shape
    group = st["group"]
    pages = -(-L // page)
    far = ~st["in_win"]                                                           # [n_q, L]
    pad = pages * page - L
    if rule.endswith(("-norm", "-vote")):
        # per row and head, each page's score as a share over pages (softmax, or 1 for its top pages),
        # averaged over rows and the group's heads
        per = page_scores_rows(st, rule.split("-")[0], page)                 # [Hq, n_q, pages]
        per = per * st.get("temp", 1.0)
        if rule.endswith("-norm"):
            x = torch.softmax(per, -1)
        else:
            k_top = 16
            x = torch.zeros_like(per).scatter_(-1, per.topk(min(k_top, pages), -1).indices, 1.0)
        return x.mean(1).view(-1, group, pages).mean(1)
    if rule == "exact":
        x = torch.where(far, st["s_far"], float("-inf"))
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).view(heads_q, n_q, pages, page)
        return x.amax((1, 3)).view(-1, group, pages).amax(1)
    if rule == "mass":
        x = torch.softmax(torch.where(far, st["s_far"], float("-inf")), -1)
        x = torch.nn.functional.pad(x, (0, pad)).view(heads_q, n_q, pages, page)
        return x.sum(3).mean(1).view(-1, group, pages).mean(1)
    if rule.startswith(("sparq", "pca")):
        # approximate logits from r components, then each page's share of the row's far mass, as "mass"
        r_dims = int(rule.lstrip("sparqca"))
        kf, qf = st["k_far"], st["q_far"]                                      # [L, Hq, d], [n_q, Hq, d]
        if rule.startswith("sparq"):                                           # the r largest |q_i| per row, head
            idx = qf.abs().topk(r_dims, -1).indices
            qs = torch.zeros_like(qf).scatter_(-1, idx, qf.gather(-1, idx))
            approx = torch.einsum("rhd,jhd->hrj", qs, kf)
        else:                                                                  # keys' top principal directions
            approx = torch.empty(heads_q, n_q, L, dtype=torch.float64)
            for h in range(heads_q):
                x = kf[:, h]
                u = torch.linalg.svd(x - x.mean(0), full_matrices=False).Vh[:r_dims]   # [r, d]
                mu = x.mean(0)
                approx[h] = (qf[:, h] @ mu)[:, None] + (qf[:, h] @ u.T) @ (u @ (x - mu).T)
        x = torch.softmax(torch.where(far, approx, float("-inf")), -1)
        x = torch.nn.functional.pad(x, (0, pad)).view(heads_q, n_q, pages, page)
        return x.sum(3).mean(1).view(-1, group, pages).mean(1)
    if rule == "moment":
        # log of each page's estimated mass per row / head: log P + q.mu + q^2.var / 2 (Gaussian keys), as a
        # share of the row's estimated far mass, averaged over rows and the group's heads
        kf = st["k_far"]
        nc = L // page
        kf = kf[:nc * page].view(nc, page, heads_q, -1)
        mu, var = kf.mean(1), kf.var(1, unbiased=False)
        qf = st["q_far"]
        lm = torch.einsum("rhd,thd->hrt", qf, mu) + 0.5 * torch.einsum("rhd,thd->hrt", qf * qf, var)
        share = torch.softmax(lm, -1).mean(1).view(-1, group, nc).mean(1)
        return torch.nn.functional.pad(share, (0, pages - nc), value=float("-inf"))
    if rule in ("bound", "mean", "sample"):
        # the box bound (or the mean key's logit, or a random key's) per query row / head, max over rows and heads
        kf = st["k_far"]                                                          # [L, Hq, d]
        kf = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad), value=float("nan")).view(pages, page, heads_q, -1)
        qf = st["q_far"]                                                          # [n_q, Hq, d] (alpha, scale folded)
        if rule == "bound":
            hi, lo = kf.nan_to_num(float("-inf")).amax(1), kf.nan_to_num(float("inf")).amin(1)      # [pages, Hq, d]
            sc = (torch.einsum("rhd,thd->htr", qf.clamp(min=0), hi) + torch.einsum("rhd,thd->htr", qf.clamp(max=0), lo))
        else:
            mu = kf.nanmean(1)
            sc = torch.einsum("rhd,thd->htr", qf, mu)
        return sc.amax(-1).view(-1, group, pages).amax(1)
    raise ValueError(rule)


def page_scores_rows(st, rule, page):
    """[Hq, n_q, pages]: each page's exact largest far logit, or its box bound, per row and head (-inf: not
    wholly far)."""
    heads_q, n_q, L = st["s_far"].shape
    nc = (st["n"] - st["D"] + 1) // page                    # candidate pages: wholly far for every row
    pages = -(-L // page)
    if rule == "exact":
        x = st["s_far"][:, :, :nc * page].reshape(heads_q, n_q, nc, page).amax(-1)
    elif rule == "exact1":                                   # one query per head: the block's mean far query
        kf = st["k_far"][:nc * page]
        x = torch.einsum("hd,jhd->hj", st["q_far"].mean(0), kf).view(heads_q, 1, nc, page).amax(-1)
    elif rule[0] == "q" and rule[1].isdigit():               # keys quantized to b bits per dim inside the page's box
        bits = int(rule[1])
        kf = st["k_far"][:nc * page].view(nc, page, heads_q, -1)
        hi, lo = kf.amax(1, keepdim=True), kf.amin(1, keepdim=True)
        levels = 2 ** bits
        step = (hi - lo).clamp(min=1e-30) / levels
        code = ((kf - lo) / step).floor().clamp(0, levels - 1)
        kq = (lo + (code + 0.5) * step).view(nc * page, heads_q, -1)
        qf = st["q_far"].mean(0, keepdim=True) if rule.endswith("r1") else st["q_far"]
        x = torch.einsum("rhd,jhd->hrj", qf, kq).reshape(heads_q, qf.shape[0], nc, page).amax(-1)
    elif rule.startswith("pcabox"):                          # the box in the keys' principal basis
        calib = int(rule[6:]) if len(rule) > 6 else L
        kf = st["k_far"]
        x = torch.empty(heads_q, n_q, nc, dtype=torch.float64)
        for h in range(heads_q):
            c = kf[:calib, h]
            u = torch.linalg.svd(c - c.mean(0), full_matrices=False).Vh         # [d, d] orthonormal rows
            kr = (kf[:nc * page, h] @ u.T).view(nc, page, -1)
            hi, lo = kr.amax(1), kr.amin(1)
            qr = st["q_far"][:, h] @ u.T
            x[h] = qr.clamp(min=0) @ hi.T + qr.clamp(max=0) @ lo.T
    elif rule in ("mean", "half"):
        kf = st["k_far"][:nc * page].view(nc, page, heads_q, -1)
        qf = st["q_far"]
        x = torch.einsum("rhd,thd->hrt", qf, kf.mean(1))
        if rule == "half":
            hi, lo = kf.amax(1), kf.amin(1)
            b = torch.einsum("rhd,thd->hrt", qf.clamp(min=0), hi) + torch.einsum("rhd,thd->hrt", qf.clamp(max=0), lo)
            x = 0.5 * (x + b)
    else:
        kf = st["k_far"][:nc * page].view(nc, page, heads_q, -1)
        hi, lo = kf.amax(1), kf.amin(1)
        qf = st["q_far"]
        x = torch.einsum("rhd,thd->hrt", qf.clamp(min=0), hi) + torch.einsum("rhd,thd->hrt", qf.clamp(max=0), lo)
    return torch.nn.functional.pad(x, (0, pages - nc), value=float("-inf"))


def rule_read(st, rule, budget, page, alpha):
    """(output, far_read [Hq, n_q, L]) of a budgeted read by ``rule``."""
    heads_q, n_q, L = st["s_far"].shape
    group = st["group"]
    base = rule.split("+")[0]
    n, D = st["n"], st["D"]
    pages = -(-L // page)
    win_lo = n - D + 1                                     # entries < win_lo: far for every row
    far_hi = win_lo + n_q - 1
    t = torch.arange(pages)
    candidate = (t + 1) * page <= win_lo
    straddler = (t * page < far_hi) & ~candidate
    slots = budget // page - int(straddler.sum())
    score = page_scores(st, base, page)                    # [Hkv, pages]
    score = torch.where(candidate, score, float("-inf"))
    best = torch.sort(-score, dim=-1, stable=True).indices[:, :max(slots, 0)]
    read_page = straddler.expand(score.shape[0], -1).clone()
    read_page.scatter_(1, best, candidate.expand_as(score).gather(1, best))
    page_of = torch.arange(L) // page
    read = read_page.repeat_interleave(group, 0)[:, page_of]                      # [Hq, L]
    far_read = read[:, None, :].expand(heads_q, n_q, L)
    extra = None
    if rule.endswith("+rest"):
        nc = int(candidate.sum())                                                 # candidates: the first nc pages
        unread = (candidate[None] & ~read_page).repeat_interleave(group, 0)[:, :nc]   # [Hq, nc]
        kf = st["k_far"][:nc * page].view(nc, page, heads_q, -1)
        vv = st["v"][:nc * page].view(nc, page, heads_q, -1)
        if base == "sample":
            mu, nu = kf[:, 0], vv[:, 0]
        else:
            mu, nu = kf.mean(1), vv.mean(1)                                       # [nc, Hq, d]
        lg = torch.einsum("rhd,thd->hrt", st["q_far"], mu) + torch.log(torch.tensor(float(page), dtype=torch.float64))
        if base in ("moment", "mass"):
            lg = lg + 0.5 * torch.einsum("rhd,thd->hrt", st["q_far"] ** 2, kf.var(1, unbiased=False))
        lg = torch.where(unread[:, None, :], lg, float("-inf"))
        extra = (lg, nu.transpose(0, 1))
    return combine(st, far_read, alpha, extra), far_read


def analyse(q, k, v, *, window, rope, alpha, budget, page, rules):
    st = dense_states(q, k, v, window=window, rope=rope, alpha=alpha)
    n_q, heads_q, _ = q.shape
    _with_far_queries(st, q, rope, alpha)
    L = k.shape[0]
    everything = torch.ones(heads_q, n_q, L, dtype=torch.bool)
    o_fold = combine(st, everything, alpha)
    o_win = combine(st, torch.zeros_like(everything), alpha)
    mass = torch.softmax(torch.where(~st["in_win"], st["s_far"], float("-inf")), -1)       # [Hq, n_q, L]
    lse_n = torch.logsumexp(torch.where(st["in_win"], st["s_win"], float("-inf")), -1)
    lse_f = torch.logsumexp(torch.where(~st["in_win"], st["s_far"], float("-inf")), -1) / alpha
    far_share = torch.sigmoid(lse_f - lse_n).mean().item()
    span = (o_fold - o_win).norm().item()
    out = dict(far_share=far_share)
    srt = mass.sort(-1, descending=True).values.cumsum(-1)                      # entries covering 50 / 80 % of the mass
    nfar = (~st["in_win"]).sum(-1).double()                                     # [n_q]
    for c in (0.5, 0.8):
        out[f"entries{int(c * 100)}"] = ((srt < c).sum(-1).double() + 1).div(nfar).mean().item()
    for rule in rules:
        o, read = rule_read(st, rule, budget, page, alpha)
        out[rule] = dict(recall=(mass * read).sum(-1).mean().item(), err=(o - o_fold).norm().item() / max(span, 1e-30))
    return out


def _list_recall(args, target, drafter, tokenizer, held):
    """``--list-recall``: fold.far_pages.select_pages on the drafter's inputs, by rank and list size."""
    from fold import far_pages, spec_decode
    from fold.demo import experiment

    seen = []
    policy = watching(args, drafter, lambda q, k, v, rope: seen.append((q.clone(), k.clone(), rope)))
    lists = {"max(2K,16)": (2, 16), "max(K,8)": (1, 8), "every group": (1 << 30, 1 << 30)}
    saved = far_pages.SHORTLIST_PER_SLOT, far_pages.SHORTLIST_MIN
    for length in args.lengths:
        ids, _, _ = experiment.prompts_for(args.task, length, args.prompts, args.seed, held, tokenizer, 32)
        recall = {}
        for p in range(ids.shape[0]):
            seen.clear()
            spec_decode.generate(target, drafter, ids[p:p + 1], max_new_tokens=8, policy=policy)
            for q, k, rope in seen:
                st = dense_states(q[0], k[0], k[0], window=args.window, rope=rope, alpha=args.alpha)
                mass = torch.softmax(torch.where(~st["in_win"], st["s_far"], float("-inf")), -1)  # [Hq, n_q, L]
                n_q, L, heads_kv = q.shape[1], k.shape[1], k.shape[2]
                for page in args.page:
                    bounds = far_pages.page_bounds(k, page)
                    q_far = far_pages.far_queries(q, rope, None, window=args.window, max_len=L, queries_rotated=False)
                    for name, sizes in lists.items():
                        far_pages.SHORTLIST_PER_SLOT, far_pages.SHORTLIST_MIN = sizes
                        for rank in far_pages.RANKS:
                            pages = far_pages.select_pages(
                                q_far, bounds, far_pages.KeyCache(k, rope=rope), span=args.window + n_q,
                                far_page=page, num_slots=args.budget // page, scale=args.alpha * q.shape[-1] ** -0.5,
                                rank=rank)
                            read = torch.zeros(heads_kv, -(-L // page), dtype=torch.bool)
                            for h in range(heads_kv):
                                read[h, pages[0, h][pages[0, h] >= 0].long()] = True
                            entries = read.repeat_interleave(st["group"], 0)[:, torch.arange(L) // page]
                            recall.setdefault((page, name, rank), []).append(
                                (mass * entries[:, None, :]).sum(-1).mean().item())
                    far_pages.SHORTLIST_PER_SLOT, far_pages.SHORTLIST_MIN = saved
        for (page, name, rank), values in recall.items():
            print(json.dumps(dict(length=ids.shape[1], page=page, list=name, rank=rank, reads=len(values),
                                  recall=round(statistics.mean(values), 4))), flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--page", type=int, nargs="+", default=[64])
    ap.add_argument("--window", type=int, default=None, help="default: 128, or 256 with --real")
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--tau", choices=RULES, default=None, help="measure tau with this rule instead")
    ap.add_argument("--task", default="retrieval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", action="store_true", help="compare the dense read with fold.attention and stop")
    ap.add_argument("--list-recall", action="store_true", help="recall of the library's selection by list size")
    ap.add_argument("--real", action="store_true", help="with --tau: fold-demo --real's cells (the real pair)")
    args = ap.parse_args(argv)
    if args.real and args.tau is None:
        ap.error("--real goes with --tau")
    return args


def watching(args, drafter, keep):
    """A ``policy`` for :func:`fold.spec_decode.generate`: FOLD's read, unchanged, that hands every read
    with a far memory to ``keep(q, k, v, rope)`` first (pre-RoPE ``[1, n_q, Hq, d]`` / ``[1, L, Hkv, d]``)."""
    from fold.spec_decode.policies import Read, make_read

    rope = drafter.cfg.rope

    def policy(request):
        read = make_read("fold", rope, request=request, window=args.window, alpha=args.alpha)

        def full(q, k, v, layer):
            if k.shape[1] - q.shape[1] > args.window:
                keep(q, k, v, rope)
            return read(q, k, v, layer)
        return Read(full, read.sliding, rope=rope)
    return policy


def rule_policy(args, drafter, page):
    """The budget row's ``policy``: a far read of ``args.budget`` entries in pages of ``page`` chosen by
    the rule ``args.tau`` (this file's dense float64 read), FOLD's own read while nothing is far."""
    from fold.spec_decode.policies import Read, make_read

    rope = drafter.cfg.rope

    def policy(request):
        read = make_read("fold", rope, request=request, window=args.window, alpha=args.alpha)

        def full(q, k, v, layer):
            if k.shape[1] - q.shape[1] <= args.window:
                return read(q, k, v, layer)
            st = dense_states(q[0], k[0], v[0], window=args.window, rope=rope, alpha=args.alpha)
            _with_far_queries(st, q[0], rope, args.alpha)
            o, _ = rule_read(st, args.tau, args.budget, page, args.alpha)
            return o[None].to(q.dtype)
        return Read(full, read.sliding, rope=rope)
    return policy


def run_check(args, target, drafter, tokenizer, held):
    """``--check``: the dense float64 read against ``fold.attention`` on the drafter's own inputs."""
    import fold
    from fold import spec_decode
    from fold.demo import experiment

    seen = []
    policy = watching(args, drafter, lambda q, k, v, rope: seen.append((q.double(), k.double(), v.double(), rope)))
    ids, _, _ = experiment.prompts_for(args.task, args.lengths[0], 1, args.seed, held, tokenizer, 32)
    spec_decode.generate(target, drafter, ids, max_new_tokens=8, policy=policy)
    worst = {"fold": 0.0, "bound": 0.0}
    for q, k, v, rope in seen:
        opts = dict(window=args.window, rope=rope, alpha=args.alpha, backend="torch")
        st = dense_states(q[0], k[0], v[0], window=args.window, rope=rope, alpha=args.alpha)
        _with_far_queries(st, q[0], rope, args.alpha)
        full = combine(st, torch.ones(q.shape[2], q.shape[1], k.shape[1], dtype=torch.bool), args.alpha)
        worst["fold"] = max(worst["fold"], (full[None] - fold.attention(q, k, v, **opts)).abs().max().item())
        for page in args.page:
            lib = fold.attention(q, k, v, far_budget=args.budget, far_page=page, **opts)
            mine = rule_read(st, "bound", args.budget, page, args.alpha)[0]
            worst["bound"] = max(worst["bound"], (mine[None] - lib).abs().max().item())
    print(f"{len(seen)} reads, float64, largest difference from fold.attention: {worst}")


def run_analysis(args, target, drafter, tokenizer, held) -> list[dict]:
    """The default: each rule's recall of FOLD's far mass and its output error, per read."""
    from fold import spec_decode
    from fold.demo import experiment

    seen, results = [], []
    policy = watching(args, drafter, lambda q, k, v, rope: seen.append((q[0].clone(), k[0].clone(), v[0].clone(),
                                                                          rope)))
    for length in args.lengths:
        ids, n_new, _ = experiment.prompts_for(args.task, length, args.prompts, args.seed, held, tokenizer, 32)
        for p in range(ids.shape[0]):
            seen.clear()
            spec_decode.generate(target, drafter, ids[p:p + 1], max_new_tokens=n_new, policy=policy)
            for page in args.page:
                rows = [analyse(q, k, v, window=args.window, rope=rope, alpha=args.alpha, budget=args.budget,
                                page=page, rules=args.rules) for q, k, v, rope in seen]
                summary = dict(length=ids.shape[1], prompt=p, page=page, reads=len(rows),
                               far_share=statistics.mean(r["far_share"] for r in rows),
                               entries50=statistics.mean(r["entries50"] for r in rows),
                               entries80=statistics.mean(r["entries80"] for r in rows))
                for rule in args.rules:
                    summary[rule] = {m: statistics.mean(r[rule][m] for r in rows) for m in ("recall", "err")}
                results.append(summary)
                print(json.dumps(summary), flush=True)
    for length in sorted({r["length"] for r in results}):
        for page in args.page:
            sel = [r for r in results if r["length"] == length and r["page"] == page]
            line = (f"L={length} P={page} far share {statistics.mean(r['far_share'] for r in sel):.3f}, "
                    f"entries for 50/80% of its mass {statistics.mean(r['entries50'] for r in sel):.3f}/"
                    f"{statistics.mean(r['entries80'] for r in sel):.3f}:")
            for rule in args.rules:
                line += (f"  {rule} recall {statistics.mean(r[rule]['recall'] for r in sel):.3f}"
                         f" err {statistics.mean(r[rule]['err'] for r in sel):.3f}")
            print(line)
    return results


def run_tau(args, target, drafter, anchor, tokenizer, held, held_text, train_len) -> list[dict]:
    """``--tau RULE``: τ with the budget row's far pages chosen by ``RULE``, paired with FOLD's."""
    from fold.demo import experiment

    results = []
    for length in (args.lengths if args.real else ()):
        for page in args.page:
            recs = experiment.run_comparison(
                target, drafter, None, tokenizer, held_ids=held, tasks=[args.task], lengths=[length],
                rows=("fold", experiment.BUDGET_ROW), prompts=args.prompts, new_tokens=24, repeats=1,
                window=args.window, alpha=args.alpha, seed=args.seed, train_len=train_len, last_logits_only=True,
                held_text=held_text, far_budget=args.budget, far_page=page,
                policies={experiment.BUDGET_ROW: rule_policy(args, drafter, page)})
            by = {r["policy"]: r for r in recs}
            b = by[experiment.BUDGET_ROW]
            summary = dict(rule=args.tau, real=True, length=b["length"], page=page, budget=args.budget,
                           taus_fold=by["fold"]["taus"], taus_rule=b["taus"], tau_fold=by["fold"]["tau"],
                           tau_rule=b["tau"], minus_fold=b["tau_minus_fold"], ci=b["tau_minus_fold_ci"],
                           lossless=b["lossless"])
            results.append(summary)
            print(json.dumps(summary), flush=True)
    for length in (() if args.real else args.lengths):
        for page in args.page:
            ids, n_new, _ = experiment.prompts_for(args.task, length, args.prompts, args.seed, held, tokenizer, 32)
            rows = experiment.make_rows(target, drafter, anchor, ["window", "fold", experiment.BUDGET_ROW],
                                        args.window, args.alpha, train_len, far_budget=args.budget, far_page=page,
                                        policies={experiment.BUDGET_ROW: rule_policy(args, drafter, page)})
            experiment.measure_cell(rows, ids, n_new, 1)
            recs = experiment.cell_records(args.task, ids.shape[1], rows)
            by = {r["policy"]: r for r in recs}
            b = by[experiment.BUDGET_ROW]
            summary = dict(rule=args.tau, length=ids.shape[1], page=page, budget=args.budget,
                           tau_window=by["window"]["tau"], tau_fold=by["fold"]["tau"], tau_rule=b["tau"],
                           minus_fold=b["tau_minus_fold"], ci=b["tau_minus_fold_ci"], lossless=b["lossless"])
            results.append(summary)
            print(json.dumps(summary), flush=True)
    return results


def main(argv=None):
    args = parse_args(argv)
    from fold.demo import corpus, experiment, tokens

    if args.real:
        from fold.demo import real

        target, drafter, anchor, tokenizer = experiment.load_real_pair()
        train_len = experiment.training_length(drafter_dir=real.DRAFTER_DIR)
    else:
        target, drafter, anchor, tokenizer = experiment.load_pair()
        train_len = experiment.training_length()
    if args.window is None:
        args.window = experiment.REAL_WINDOW if args.real else 128
    held_text = corpus.held_out_code()
    held = {name: tokens.encode(tokenizer, text) for name, text in held_text.items()}
    if args.check:
        return run_check(args, target, drafter, tokenizer, held)
    if args.list_recall:
        return _list_recall(args, target, drafter, tokenizer, held)
    if args.tau is None:
        results = run_analysis(args, target, drafter, tokenizer, held)
    else:
        results = run_tau(args, target, drafter, anchor, tokenizer, held, held_text, train_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)

if __name__ == "__main__":
    main()
