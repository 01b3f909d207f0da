"""What each rule for a block drafter's last rounds costs: ``python -m benchmarks.tail_rounds``.

``spec_decode.generate(..., tail="full")`` drafts the whole block every round and commits only the
tokens left; ``tail="shrink"`` drafts ``[anchor, MASK x (left - 1)]`` there, as upstream's
``dflash_generate`` does. Both run on the same held-out code prompts (one shared prefill each), the
same drafter and read. A *tail round* starts with fewer tokens left than a full block drafts. Prints,
per rule: rounds, tau over all rounds, tail rounds, tau over them, tokens each tail round verifies,
decode seconds; of the tail rounds at the same position under both rules, how many drafted
differently; and whether the two rules' outputs are equal (both are the target's greedy output).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from fold import spec_decode

TAILS = ("full", "shrink")


def _pair(name: str):
    from fold.demo import experiment

    target, drafter, _, tokenizer = experiment.load_real_pair() if name == "real" else experiment.load_pair()
    return target, drafter, tokenizer


def _prompts(tokenizer, count: int, length: int, seed: int) -> list[torch.Tensor]:
    from fold.demo import corpus, prompts, tokens

    held = {name: tokens.encode(tokenizer, text) for name, text in corpus.held_out_code().items()}
    newlines = [i for t, i in tokenizer.get_vocab().items() if t.startswith("Ċ")]
    rng = random.Random(f"tail-{length}-{seed}")
    return [torch.tensor(prompts.code_prompt(held, rng, length, newlines)) for _ in range(count)]


def _rounds(target, run):
    """``run()`` with each verification's (position, drafts) recorded from the target's forward calls."""
    seen = []

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and cache.get_seq_length():
            seen.append((cache.get_seq_length(), tuple(args[0][0, 1:].tolist())))

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        return run(), seen
    finally:
        handle.remove()


def measure(target, drafter, prompts, new: int, policy: str, options: dict) -> dict:
    """Per rule: the per-round records of every prompt, the outputs and decode seconds. Each prompt runs
    under both rules back to back, in alternating order, so that a shared machine's load drifts apart
    from neither."""
    shared = spec_decode.Prefills(target, last_logits_only=True)
    full_drafts = drafter.cfg.block_size - (0 if drafter.cfg.sample_from_anchor else 1)
    out = {tail: dict(rows=[], decode_s=0.0, sequences=[]) for tail in TAILS}
    for s, ids in enumerate(prompts):
        for tail in TAILS if s % 2 == 0 else TAILS[::-1]:
            result, rounds = _rounds(target, lambda: spec_decode.generate(
                target, drafter, ids[None], max_new_tokens=new, policy=policy, tail=tail, prefill=shared, **options))
            stats = result.stats["per_sequence"][0]
            out[tail]["decode_s"] += stats["decode_s"]
            out[tail]["sequences"].append(result.sequences[0])
            left = new - 1
            for (position, drafts), committed in zip(rounds, stats["committed_per_round"]):
                out[tail]["rows"].append(dict(sequence=s, position=position, drafts=drafts, committed=committed,
                                              tail=left < full_drafts))
                left -= committed
    return out


def report(out: dict, new: int, prompts: int) -> None:
    for tail in TAILS:
        rows = out[tail]["rows"]
        tails = [r for r in rows if r["tail"]]
        print(f"tail={tail:6s}: rounds {len(rows)}, tau {sum(r['committed'] for r in rows) / len(rows):.3f}; "
              f"tail rounds {len(tails)}, tau over them {sum(r['committed'] for r in tails) / len(tails):.3f}, "
              f"tokens verified per tail round {sum(len(r['drafts']) + 1 for r in tails) / len(tails):.2f}, "
              f"in all {sum(len(r['drafts']) + 1 for r in rows)}; decode {out[tail]['decode_s']:.1f} s "
              f"({prompts} x {new} tokens)")
    full = {(r["sequence"], r["position"]): r for r in out["full"]["rows"] if r["tail"]}
    both = [(full[k], r) for r in out["shrink"]["rows"] if r["tail"] and (k := (r["sequence"], r["position"])) in full]
    differ = sum(a["drafts"][:len(b["drafts"])] != b["drafts"] for a, b in both)
    print(f"tail rounds at the same position under both rules: {len(both)}; drafted differently "
          f"(first `left` drafts): {differ}; tokens committed there: full {sum(a['committed'] for a, _ in both)}, "
          f"shrink {sum(b['committed'] for _, b in both)}")
    same = all(torch.equal(a, b) for a, b in zip(out["full"]["sequences"], out["shrink"]["sequences"]))
    print(f"outputs equal under both rules (the target's greedy output): {same}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("real", "toy"), default="real")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=512, help="prompt tokens (the real drafter trained at 512)")
    ap.add_argument("--new", type=int, default=24, help="tokens generated per prompt")
    ap.add_argument("--policy", default="dflash")
    ap.add_argument("--window", type=int, default=None, help="policy option window (fold, window, ...)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, drafter, tokenizer = _pair(args.pair)
    prompts = _prompts(tokenizer, args.prompts, args.length, args.seed)
    options = {} if args.window is None else dict(window=args.window)
    with torch.no_grad():
        out = measure(target, drafter, prompts, args.new, args.policy, options)
    print(f"pair {args.pair}, policy {args.policy} {options}, block {drafter.cfg.block_size}, {args.prompts} prompts "
          f"x {args.length} tokens, {args.new} new, {args.threads} thread(s)")
    report(out, args.new, args.prompts)
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
