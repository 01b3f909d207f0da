"""Train the demo target (``fold_toy``) and its BPE tokenizer, on the CPU or a GPU.

    python -m examples.train_target --out fold/demo/artifacts/target --minutes 40 --batch 4 --threads 1

1. Tokenizer: a byte-level BPE of ``--vocab`` entries (``fold.demo.tokens.train_tokenizer``) trained
   on the training split (the standard library found on this machine, held-out packages excluded,
   plus generated documents), written as ``tokenizer.json`` next to the model (``AutoTokenizer``
   loads it). ``--tokenizer DIR`` reuses an existing one instead.
2. Model: sliding-window RoPE layers around one global NoPE layer (an induction head at the start,
   value/output path included; its q/k convolutions train at ``--qk-lr-scale`` times the learning
   rate), and a context channel holding codes of the token and the ``--channel-lags`` tokens before
   it (fixed random codes, not trained). Beyond ``--seq-len`` entries the global layer sharpens its
   logits by ``ln n / ln seq_len`` (the identity within the training length). Data: ``--seq-len``-token windows
   of code, key-value, repeated-line and random-string documents in the shares ``--mix``. AdamW with
   a cosine schedule over ``--minutes`` (or ``--max-steps``); fixed seeds.

Writes the model with ``save_pretrained`` in bfloat16, the tokenizer, and ``train_log.json`` (device,
threads, wall time, loss curve, held-out loss by length, retrieval accuracy by length).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from fold.argtypes import positive
from fold import spec_decode
from fold.demo import FoldToyConfig, FoldToyForCausalLM, corpus, documents, prompts, tokens
from fold.files import write_atomically, write_text_atomically

MIX_HELP = "shares of code, key-value, repeated-line and random-string windows (summing to 1)"


def check_mix(parser, mix, n=len(documents.DOCUMENT_KINDS)):
    if len(mix) != n or any(m < 0 or m != m for m in mix) or abs(sum(mix) - 1) > 1e-6:
        parser.error(f"--mix takes {n} shares >= 0 summing to 1 ({', '.join(documents.DOCUMENT_KINDS)}), got {mix}")


def check_device(parser, device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        parser.error(f"--device {device!r}: {exc}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if dev.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {device!r}")
    return dev


def tokenizer_texts(rng, code: str, per_kind: int = 150):
    """The tokenizer's training text: the training code in 100K-character pieces, then ``per_kind``
    generated documents of 4,000 characters of each kind (key-value, repeated lines, random strings)."""
    yield from (code[i:i + 100_000] for i in range(0, len(code), 100_000))
    for kind in documents.DOCUMENT_KINDS[1:]:
        for _ in range(per_kind):
            yield documents.training_text(rng, code, 4000, kind)


def batch_of(rng, tokenizer, code, batch, seq_len, mix):
    return torch.tensor([documents.training_sample(rng, tokenizer, code, seq_len, mix) for _ in range(batch)])


@torch.no_grad()
def held_out_loss(model, held_ids, lengths, rng, device, samples=2):
    """Mean next-token loss (nats) over the last 256 tokens of held-out windows of each length."""
    out = {}
    for length in lengths:
        losses = []
        for _ in range(samples):
            ids = torch.tensor([prompts.code_prompt(held_ids, rng, length)], device=device)
            n = min(256, length - 1)
            logits = model(ids).logits[0, -n - 1:-1].float()
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, -n:]).item())
        out[length] = round(sum(losses) / len(losses), 4)
    return out


@torch.no_grad()
def retrieval_accuracy(model, tokenizer, rng, length, device, trials=4):
    """Share of greedy continuations of a retrieval prompt (key stored at least half the prompt back)
    that reproduce the stored value."""
    hits = 0
    for _ in range(trials):
        prompt, answer = prompts.retrieval_prompt(rng, tokenizer, length, length // 2)
        out = spec_decode.autoregressive(model, torch.tensor([prompt], device=device), max_new_tokens=len(answer))
        hits += out.sequences[0, len(prompt):].tolist() == answer
    return hits / trials


def param_groups(model, lr, qk_lr_scale):
    slow = ("q_conv.weight", "k_conv.weight")
    qk = [p for n, p in model.named_parameters() if n.endswith(slow)]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith(slow)]
    flat = [p for p in model.parameters() if p.ndim < 2]
    return [dict(params=qk, lr=lr * qk_lr_scale, base_lr=lr * qk_lr_scale, weight_decay=0.0),
            dict(params=decay, lr=lr, base_lr=lr, weight_decay=0.1),
            dict(params=flat, lr=lr, base_lr=lr, weight_decay=0.0)]


def build_model(args, vocab_size: int, mask_token_id: int) -> FoldToyForCausalLM:
    small = args.hidden < 256
    cfg = FoldToyConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                        head_dim=64 if not small else args.hidden // 4, sliding_window=args.sliding_window,
                        channel_lags=args.channel_lags, channel_width=args.channel_width,
                        global_log_scale_from=args.seq_len, mask_token_id=mask_token_id)
    model = FoldToyForCausalLM(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "induction_init"):
                layer.self_attn.induction_init(generator=gen, copy_gain=args.copy_gain)
        model.init_context_channel(generator=gen)
        if args.copy_gain > 0:      # the LM head starts as the embedding: a copied input reads as its token
            model.lm_head.weight.copy_(model.model.embed_tokens.weight / math.sqrt(args.hidden))
    return model


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None, help="reuse this tokenizer directory (default: train one)")
    ap.add_argument("--vocab", type=int, default=3072, help="BPE vocabulary size, specials included (>= 300)")
    ap.add_argument("--minutes", type=positive(float), default=40.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=positive(int), default=None)
    ap.add_argument("--seq-len", type=positive(int), default=1024, help="tokens per training window")
    ap.add_argument("--batch", type=positive(int), default=4)
    ap.add_argument("--lr", type=positive(float), default=3e-3)
    ap.add_argument("--qk-lr-scale", type=positive(float), default=0.1)
    ap.add_argument("--hidden", type=positive(int), default=256)
    ap.add_argument("--sliding-window", type=positive(int), default=256, help="the local layers' window (tokens)")
    ap.add_argument("--copy-gain", type=float, default=8.0,
                    help="the global layer's value/output path starts as a copy of this gain (0: random)")
    ap.add_argument("--channel-lags", type=int, default=5, help="earlier tokens in the context channel (0: no channel)")
    ap.add_argument("--channel-width", type=int, default=12, help="dimensions of each token code in the channel")
    ap.add_argument("--mix", type=float, nargs=len(documents.DOCUMENT_KINDS), default=[0.5, 0.2, 0.15, 0.15],
                    help=MIX_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the same code runs on both)")
    ap.add_argument("--threads", type=positive(int), default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--eval-lengths", type=positive(int), nargs="*", default=[512, 2048, 8192])
    ap.add_argument("--stdlib", type=Path, default=None, help="source tree (default: this Python's stdlib)")
    args = ap.parse_args(argv)
    check_mix(ap, args.mix)
    args.device = check_device(ap, args.device)
    if args.vocab < 300:
        ap.error(f"--vocab must be >= 300 (256 bytes, 2 special tokens and some merges), got {args.vocab}")
    if args.channel_lags < 0 or (args.channel_lags and args.channel_width < 1):
        ap.error(f"--channel-lags must be >= 0 and --channel-width >= 1, got {args.channel_lags}, {args.channel_width}")
    if args.channel_lags and 1 + (args.channel_lags + 1) * args.channel_width >= args.hidden // 2:
        ap.error(f"the context channel (1 + (lags + 1) * width dims) must be under half of --hidden {args.hidden}")
    if args.copy_gain < 0:
        ap.error(f"--copy-gain must be >= 0, got {args.copy_gain}")
    if args.hidden % 4:
        ap.error(f"--hidden must be a multiple of 4 (4 heads), got {args.hidden}")
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer.json").is_file():
        ap.error(f"--tokenizer {args.tokenizer} has no tokenizer.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    code, held = corpus.split_corpus(args.stdlib)
    args.out.mkdir(parents=True, exist_ok=True)
    t_tok = time.perf_counter()
    if args.tokenizer is None:
        tok = tokens.train_tokenizer(tokenizer_texts(random.Random(args.seed), code), args.vocab)
        tokens.save_tokenizer(tok, args.out)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (args.tokenizer / name).is_file() and args.tokenizer.resolve() != args.out.resolve():
                shutil.copy(args.tokenizer / name, args.out / name)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.out)
    tok_seconds = time.perf_counter() - t_tok
    held_ids = {name: tokens.encode(tokenizer, text) for name, text in held.items()}
    model = build_model(args, len(tokenizer), tokenizer.mask_token_id).to(args.device)
    opt = torch.optim.AdamW(param_groups(model, args.lr, args.qk_lr_scale), betas=(0.9, 0.95))
    channel = model.model.embed_tokens.weight[:, model.config.write_dims:].detach().clone()   # kept fixed
    budget = args.minutes * 60
    log = dict(args={k: str(v) for k, v in vars(args).items()}, device=str(args.device),
               device_name=(torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"),
               threads=torch.get_num_threads(), params=sum(p.numel() for p in model.parameters()),
               vocab_size=len(tokenizer), tokenizer_seconds=round(tok_seconds, 1), steps=[])
    print(f"fold_toy target: {log['params'] / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
          f"{len(code) / 1e6:.1f} MB of training code, on {args.device}")
    t0, step = time.perf_counter(), 0
    model.train()
    while True:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1 or (args.max_steps is not None and step >= args.max_steps):
            break
        warm = min(1.0, (step + 1) / 30)
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * warm * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        ids = batch_of(rng, tokenizer, code, args.batch, args.seq_len, args.mix).to(args.device)
        with torch.autocast(args.device.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model.model.embed_tokens.weight[:, model.config.write_dims:] = channel
        step += 1
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - t0
            log["steps"].append(dict(step=step, seconds=round(elapsed, 1), loss=round(loss.item(), 4)))
            print(f"step {step:5d}  {elapsed / 60:5.1f} min  loss {loss.item():.3f} nats/token", flush=True)
    model.eval()
    log["train_seconds"] = round(time.perf_counter() - t0, 1)
    log["total_steps"] = step
    eval_rng = random.Random(1234)
    log["held_out_loss"] = held_out_loss(model, held_ids, args.eval_lengths, eval_rng, args.device)
    log["retrieval_accuracy"] = {n: retrieval_accuracy(model, tokenizer, eval_rng, n, args.device)
                                 for n in args.eval_lengths if n >= 128}
    print("held-out loss (nats/token):", log["held_out_loss"])
    print("retrieval accuracy:", log["retrieval_accuracy"])
    # save_pretrained's safetensors write leaves the weights at 0600 whatever the umask: it writes into
    # a hidden staging folder, and each file reaches args.out through fold.files (a plain file's mode)
    with tempfile.TemporaryDirectory(dir=args.out, prefix=".staging-") as staging:
        model.to(torch.bfloat16).save_pretrained(staging)
        for src in sorted(Path(staging).iterdir()):
            write_atomically(args.out / src.name, lambda tmp, src=src: shutil.copyfile(src, tmp))
    write_text_atomically(args.out / "train_log.json", json.dumps(log, indent=1))
    return log


if __name__ == "__main__":
    main()
