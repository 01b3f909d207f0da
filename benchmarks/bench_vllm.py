"""Stock DFlash vs fold in vLLM on the same prompts: acceptance length and time per output token.

    python -m benchmarks.bench_vllm --target ~/.cache/fold/smollm2-135m-instruct --drafter DRAFTER \\
        --lengths 2048 4096 8000 --out vllm-bench.json

Run in the vLLM environment (README: "Serving with vLLM"). For each row (``ar``: no speculation,
``dflash``: the stock drafter read, ``window`` and ``fold``: the drafter through fold's backend with
``--window`` / ``--alpha``) one engine serves every prompt, one request at a time, greedy; per prompt
it reads vLLM's own counters before and after: spec-decode drafts and accepted tokens (acceptance
length = 1 + accepted / drafts, the tokens a round commits) and the per-request time per output
token histogram. Prompts: held-out Python stdlib code and retrieval prompts (``fold.demo.prompts``),
tokenized with the target's tokenizer: ``--retrieval planted`` (default) plants one
``SECRET_... = "value"`` line in held-out code, as ``fold-demo --real`` does; ``kv`` uses the toy's
key-value documents; a retrieval prompt generates as many tokens as its stored value has (code:
``--new-tokens``), and is kept only if ``ar``'s output is its stored value
(the target retrieves it): up to ``DRAWS`` prompts are drawn per prompt wanted, ``ar`` runs them all
and the other rows run the kept ones. Every row's output is checked equal to ``ar``'s. A benchmark,
not a test: an absolute time means something on this machine only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROWS = ("ar", "dflash", "window", "fold")
DRAWS = 3                   # retrieval prompts drawn per prompt wanted, for the ones the target retrieves


def prompts(target: Path, lengths, per_length: int, seed: int, retrieval: str = "planted"):
    """``[(task, length, ids, answer)]``: ``per_length`` code prompts of each length (``answer`` None)
    and ``DRAWS * per_length`` retrieval candidates (``answer``: the stored value's ids)."""
    from transformers import AutoTokenizer

    from fold.demo import corpus, tokens
    from fold.demo.prompts import code_prompt, planted_retrieval_prompt, retrieval_prompt

    tokenizer = AutoTokenizer.from_pretrained(target)
    rng = random.Random(seed)
    code = corpus.held_out_code()
    held_out = {name: tokens.encode(tokenizer, text) for name, text in code.items()}
    newline = tokens.encode(tokenizer, "\n")
    out = []
    for length in lengths:
        for _ in range(per_length):
            out.append(("code", length, code_prompt(held_out, rng, length, newline), None))
        for _ in range(DRAWS * per_length):
            if retrieval == "planted":
                ids, answer = planted_retrieval_prompt(rng, tokenizer, code, length, length // 2)
            else:
                ids, answer = retrieval_prompt(rng, tokenizer, length, length // 2)
            out.append(("retrieval", length, ids, answer))
    return out


def keep_answered(items, ar_results, per_length: int) -> list[int]:
    """Indices of the items the other rows run: every code prompt, and per length the first
    ``per_length`` retrieval prompts whose ``ar`` output begins with their stored value."""
    from fold.demo.prompts import retrieved

    kept, taken = [], {}
    for i, ((task, length, _, answer), got) in enumerate(zip(items, ar_results)):
        if answer is None:
            kept.append(i)
        elif taken.get(length, 0) < per_length and retrieved(got["tokens"], answer):
            taken[length] = taken.get(length, 0) + 1
            kept.append(i)
    return kept


def counters(llm) -> dict:
    got = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and not m.name.endswith("per_pos"):
            got[m.name.removeprefix("vllm:spec_decode_num_")] = m.value
        elif m.name == "vllm:request_time_per_output_token_seconds":
            got["tpot_sum"], got["tpot_count"] = m.sum, m.count
    return got


def run_row(row, args, items):
    import fold.vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if row != "ar":
        drafter = args.drafter
        if row != "dflash":
            block = dict(read=row, window=args.window, **({"alpha": args.alpha} if row == "fold" else {}))
            drafter = fold.vllm.configure(args.drafter, Path(tempfile.mkdtemp()) / f"drafter-{row}", **block)
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.k}
    llm = LLM(model=str(args.target), dtype="float32", max_model_len=args.max_model_len, enforce_eager=True,
              skip_tokenizer_init=True, seed=0, speculative_config=spec, disable_log_stats=False)
    results = []
    for task, length, ids, answer in items:
        # a retrieval prompt generates its stored value, so its acceptance measures the copy
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens if answer is None else len(answer),
                                ignore_eos=True)
        before = counters(llm)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        after = counters(llm)
        delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        drafts = delta.get("drafts", 0)
        results.append(dict(task=task, length=length, tokens=list(out.outputs[0].token_ids), wall_s=wall,
                            tpot_s=delta["tpot_sum"] / max(delta["tpot_count"], 1),
                            acceptance_length=(1 + delta["accepted_tokens"] / drafts) if drafts else None))
    del llm
    gc.collect()
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="HF directory of the target")
    ap.add_argument("--drafter", type=Path, required=True, help="z-lab DFlash directory for it")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per task and length")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retrieval", choices=("planted", "kv"), default="planted",
                    help="retrieval prompts: a planted line in held-out code, or the toy's key-value documents")
    ap.add_argument("--out", type=Path, default=Path("vllm-bench.json"))
    args = ap.parse_args(argv)
    if "ar" not in args.rows:
        ap.error("--rows must include ar (every output is checked against it)")
    drawn = prompts(args.target, args.lengths, args.prompts, args.seed, args.retrieval)
    ar = run_row("ar", args, drawn)
    kept = keep_answered(drawn, ar, args.prompts)
    items = [drawn[i] for i in kept]

    def count(some, length):
        return sum(1 for task, n, *_ in some if task == "retrieval" and n == length)
    answered = {length: f"{count(items, length)}/{count(drawn, length)}" for length in args.lengths}
    rows = {row: [ar[i] for i in kept] if row == "ar" else run_row(row, args, items) for row in args.rows}
    for row, results in rows.items():
        for got, want in zip(results, rows["ar"]):
            got["lossless"] = got["tokens"] == want["tokens"]
    args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()},
                                        retrieval_answered_of_drawn=answered, rows=rows), indent=1))
    print(f"retrieval prompts the target answered, of those drawn, by length: {answered}")
    print(f"{'task':<10} {'length':>6} " + " ".join(f"{row + ' acc/TPOT':>22}" for row in args.rows))
    for i, (task, length, *_) in enumerate(items):
        cells = []
        for row in args.rows:
            r = rows[row][i]
            acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
            cells.append(f"{acc:>6} {1e3 * r['tpot_s']:8.0f} ms{'' if r['lossless'] else ' !='}".rjust(22))
        print(f"{task:<10} {length:>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
