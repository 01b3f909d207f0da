"""Train the demo target (``fold_toy``: sliding-window RoPE layers + one global NoPE layer) on CPU.

    python examples/train_target.py --out fold/demo/artifacts/target --minutes 18

Data: the standard library found on this machine (held-out packages excluded), key-value and
repeated-line documents (``fold.demo.data``), ``--seq-len`` byte windows. The global layer starts as
an induction head and its q/k convolutions train at a tenth of the learning rate. AdamW with a
cosine schedule over the wall-clock budget; fixed seeds. Writes the model with ``save_pretrained``
in bfloat16 and ``train_log.json`` (loss curve, held-out loss by length, retrieval accuracy).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from fold import spec
from fold.demo import FoldToyConfig, FoldToyForCausalLM, data


def batch_of(rng, code, batch, seq_len):
    return torch.tensor([list(data.training_sample(rng, code, seq_len)) for _ in range(batch)])


@torch.no_grad()
def held_out_loss(model, held, lengths, rng, samples=2):
    """Mean next-byte loss (nats) over the last 256 bytes of held-out windows of each length."""
    out = {}
    for length in lengths:
        losses = []
        for _ in range(samples):
            ids = torch.tensor([list(data.code_prompt(held, rng, length))])
            n = min(256, length - 1)
            logits = model(ids).logits[0, -n - 1:-1].float()
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, -n:]).item())
        out[length] = sum(losses) / len(losses)
    return out


@torch.no_grad()
def retrieval_accuracy(model, rng, length, trials=4, min_distance=None):
    """Share of greedy continuations of a retrieval prompt that reproduce the stored value."""
    hits = 0
    for _ in range(trials):
        prompt = data.retrieval_prompt(rng, length, min_distance or length // 2)
        key = prompt.rsplit(b"\n", 1)[-1]
        answer = prompt.split(b"\n" + key, 1)[1].split(b"\n", 1)[0]           # " v1 v2"
        out = spec.autoregressive(model, torch.tensor([list(prompt)]), max_new_tokens=len(answer))
        hits += bytes(out.sequences[0, len(prompt):].tolist()) == answer
    return hits / trials


def param_groups(model, lr, qk_lr_scale):
    qk = [p for n, p in model.named_parameters() if n.endswith(("q_conv.weight", "k_conv.weight"))]
    decay = [p for n, p in model.named_parameters()
             if p.ndim >= 2 and not n.endswith(("q_conv.weight", "k_conv.weight"))]
    flat = [p for p in model.parameters() if p.ndim < 2]
    return [dict(params=qk, lr=lr * qk_lr_scale, base_lr=lr * qk_lr_scale, weight_decay=0.0),
            dict(params=decay, lr=lr, base_lr=lr, weight_decay=0.1),
            dict(params=flat, lr=lr, base_lr=lr, weight_decay=0.0)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qk-lr-scale", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--eval-lengths", type=int, nargs="*", default=[512, 2048, 8192])
    ap.add_argument("--stdlib", type=Path, default=None, help="source tree (default: this Python's stdlib)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    code, held = data.split_corpus(args.stdlib)
    small = args.hidden < 256
    cfg = FoldToyConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                        head_dim=64 if not small else args.hidden // 4)
    model = FoldToyForCausalLM(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "induction_init"):
            layer.self_attn.induction_init(generator=gen)
    opt = torch.optim.AdamW(param_groups(model, args.lr, args.qk_lr_scale), betas=(0.9, 0.95))
    budget = args.minutes * 60
    log = dict(args={k: str(v) for k, v in vars(args).items()}, params=sum(p.numel() for p in model.parameters()),
               steps=[])
    print(f"fold_toy target: {log['params'] / 1e6:.2f}M parameters, {len(code) / 1e6:.1f} MB of training code")
    t0, step = time.perf_counter(), 0
    model.train()
    while True:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1 or (args.max_steps is not None and step >= args.max_steps):
            break
        warm = min(1.0, (step + 1) / 30)
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * warm * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        ids = batch_of(rng, code, args.batch, args.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - t0
            log["steps"].append(dict(step=step, seconds=round(elapsed, 1), loss=round(loss.item(), 4)))
            print(f"step {step:5d}  {elapsed / 60:5.1f} min  loss {loss.item():.3f} nats/byte", flush=True)
    model.eval()
    log["train_seconds"] = round(time.perf_counter() - t0, 1)
    log["total_steps"] = step
    eval_rng = random.Random(1234)
    log["held_out_loss"] = held_out_loss(model, held, args.eval_lengths, eval_rng)
    log["retrieval_accuracy"] = {n: retrieval_accuracy(model, eval_rng, n) for n in args.eval_lengths if n >= 1024}
    print("held-out loss (nats/byte):", log["held_out_loss"])
    print("retrieval accuracy:", log["retrieval_accuracy"])
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    return log


if __name__ == "__main__":
    main()
