"""Bytes per speculative round on an H200: the drafter's read (full FOLD vs a far budget) against the
target's verification read, and the acceptance each needs to break even with plain decoding.

    python -m benchmarks.far_budget_model                      # markdown table to stdout
    python -m benchmarks.far_budget_model --json results/bench/far-budget-model.json

A model, not a measurement: at batch 1 (and small batches) both forwards are bound by HBM traffic, so
a round costs ``bytes / bandwidth``:

- target verification (one forward over the anchor and the drafts): its weights, plus every cached
  K/V entry of its attention layers (``L x kv_bytes_per_token``), plus a linear-attention state
  where it has one (Qwen3.5's Gated DeltaNet: read once per forward);
- drafter round (one forward over a block of ``n_q`` rows): its weights (layers + ``fc``; the target's
  LM head, which a DFlash drafter reads for its slot logits), plus per drafter layer the K/V it reads:
  full FOLD reads every entry (window and far memory, ``L`` entries); with ``far_budget`` N it reads
  the window (``W + n_q``), at most N far entries and the float32 page bounds the selection scores
  (``ceil(L / P) x Hkv x 2 x d x 4``: this part still grows with ``L``, at ``2 / P`` of the full K+V
  read of a bf16 cache, 1/32 for P = 64).

Plain decoding reads the target's bytes once per token, a speculative round reads the target's and the
drafter's once per ``tau`` tokens (tau: tokens committed per round), so the speedup is
``tau x T / (T + D)`` and the break-even acceptance is ``tau* = 1 + D / T``. ``keep`` is the share of full
FOLD's tau the budgeted drafter may lose and still match full FOLD's speed: ``(T + D_budget) / (T + D_full)``.

Shapes (each stated in ``MODELS``; those marked "assumed" could not be read from a config here):
Llama-3.1-8B (32 layers, 8 KV heads of 128, 8.03e9 parameters, vocab 128,256) with a 5-layer DFlash
drafter of its width (32 / 8 heads of 128, intermediate 14,336, W = 2048, n_q = 16); Qwen3.5-9B (8 full
attention layers of 4 KV heads of 256 among 32, 24 Gated DeltaNet layers with a 32 x 128 x 128 float32
state each, ~9e9 parameters assumed, vocab 248,320 assumed) with a 6-layer drafter (the FOLD paper's
5 sliding + 1 full; under FOLD every layer reads the whole cache) of 32 / 8 heads of 128, intermediate
12,288, W = 4096, n_q = 16 (``benchmarks.workloads.DRAFTERS["qwen3.5-9b"]``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.workloads import DRAFTERS, DrafterShape

H200_BYTES_PER_S = 4.8e12          # HBM3e, NVIDIA's H200 datasheet figure
BF16 = 2


@dataclass(frozen=True)
class Model:
    name: str
    target_params: float
    target_kv_bytes_per_token: int       # K and V of every attention layer, bf16
    target_state_bytes: int              # linear-attention state read per forward (0: none)
    vocab: int
    hidden: int
    drafter_layers: int
    drafter_intermediate: int
    drafter_taps: int                    # target layers whose features fc concatenates
    attention: DrafterShape              # the drafter's attention: heads, head_dim, window, n_q
    notes: str = ""

    def drafter_weight_bytes(self) -> int:
        a, h = self.attention, self.hidden
        attn = h * a.heads_q * a.head_dim * 2 + h * a.heads_kv * a.head_dim * 2    # q, o; k, v
        mlp = 3 * h * self.drafter_intermediate
        fc = self.drafter_taps * h * h
        lm_head = self.vocab * h                                                    # the target's, read for the slots
        return (self.drafter_layers * (attn + mlp) + fc + lm_head) * BF16

    def drafter_entry_bytes(self) -> int:
        return self.attention.heads_kv * self.attention.head_dim * 2 * BF16          # K and V of one entry, one layer


MODELS = {
    "llama3.1-8b": Model("Llama-3.1-8B", 8.03e9, 32 * 8 * 128 * 2 * BF16, 0, 128256, 4096, 5, 14336, 5,
                         DrafterShape("llama3.1-8b", n_q=16, window=2048), notes="drafter layers assumed 5 (z-lab DFlash default)"),
    "qwen3.5-9b": Model("Qwen3.5-9B", 9.0e9, 8 * 4 * 256 * 2 * BF16, 24 * 32 * 128 * 128 * 4, 248320, 4096, 6, 12288, 5,
                        DRAFTERS["qwen3.5-9b"], notes="params ~9e9 and vocab 248,320 assumed; drafter 5 sliding + 1 full (FOLD paper)"),
}


def round_bytes(m: Model, length: int, budget: int | None, far_page: int, batch: int = 1) -> dict:
    """Bytes one round reads (``batch`` sequences of ``length`` entries share the weights)."""
    target = m.target_params * BF16 + batch * (length * m.target_kv_bytes_per_token + m.target_state_bytes)
    entry = m.drafter_entry_bytes()
    if budget is None:
        kv = length * entry
        bounds = 0
    else:
        a = m.attention
        far = max(0, length - a.window - a.n_q)
        kv = (min(length, a.window + a.n_q) + min(far, budget // far_page * far_page)) * entry
        bounds = math.ceil(length / far_page) * a.heads_kv * 2 * a.head_dim * 4
    drafter_kv = batch * m.drafter_layers * (kv + bounds)
    drafter = m.drafter_weight_bytes() + drafter_kv
    return dict(target=target, drafter=drafter, drafter_kv=drafter_kv,
                drafter_bounds=batch * m.drafter_layers * bounds)


def table(lengths, budget: int, far_page: int, batches) -> list[dict]:
    rows = []
    for key, m in MODELS.items():
        for batch in batches:
            for length in lengths:
                full, bud = round_bytes(m, length, None, far_page, batch), round_bytes(m, length, budget, far_page, batch)
                t = full["target"]
                rows.append(dict(
                    model=key, batch=batch, length=length, target_gb=t / 1e9, target_ms=t / H200_BYTES_PER_S * 1e3,
                    fold_drafter_gb=full["drafter"] / 1e9, fold_drafter_kv_gb=full["drafter_kv"] / 1e9,
                    budget_drafter_gb=bud["drafter"] / 1e9, budget_drafter_kv_gb=bud["drafter_kv"] / 1e9,
                    budget_bounds_gb=bud["drafter_bounds"] / 1e9,
                    fold_draft_ms=full["drafter"] / H200_BYTES_PER_S * 1e3,
                    budget_draft_ms=bud["drafter"] / H200_BYTES_PER_S * 1e3,
                    tau_break_even_fold=1 + full["drafter"] / t, tau_break_even_budget=1 + bud["drafter"] / t,
                    keep=(t + bud["drafter"]) / (t + full["drafter"])))
    return rows


def markdown(rows, budget: int, far_page: int) -> str:
    out = [f"H200 at {H200_BYTES_PER_S / 1e12:.1f} TB/s, bf16; far budget {budget} entries in pages of {far_page}. "
           "GB = 1e9 bytes per round; tau* = 1 + drafter bytes / target bytes (break-even with plain decoding); "
           "keep = tau share the budget may lose and still match full FOLD's speed.", "",
           "| target | batch | L | target verify GB (ms) | drafter, full FOLD GB (KV part) | drafter, budget GB "
           "(KV part; of which bounds) | tau* full | tau* budget | keep |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {MODELS[r['model']].name} | {r['batch']} | {r['length']:,} | {r['target_gb']:.2f} "
                   f"({r['target_ms']:.2f}) | {r['fold_drafter_gb']:.2f} ({r['fold_drafter_kv_gb']:.2f}) | "
                   f"{r['budget_drafter_gb']:.2f} ({r['budget_drafter_kv_gb']:.3f}; {r['budget_bounds_gb']:.3f}) | "
                   f"{r['tau_break_even_fold']:.2f} | {r['tau_break_even_budget']:.2f} | {r['keep']:.3f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 262144, 1048576])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--far-page", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = table(args.lengths, args.budget, args.far_page, args.batches)
    if args.json is not None:
        args.json.write_text(json.dumps(dict(models={k: asdict(m) for k, m in MODELS.items()},
                                             bandwidth=H200_BYTES_PER_S, rows=rows), indent=1))
    print(markdown(rows, args.budget, args.far_page))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
