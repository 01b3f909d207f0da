"""Train a z-lab DFlash drafter for the demo target, through fold's own drafter module, on the CPU or a GPU.

    python -m examples.train_drafter --target fold/demo/artifacts/target --out fold/demo/artifacts/drafter
    python -m examples.train_drafter ... --anchor-offset --out fold/demo/artifacts/drafter_anchor

Start: with ``--init copy`` (the default) the drafter starts as the closed-form copy circuit of
``examples/drafter_init.py`` (it needs a target with a context channel); ``--init random`` starts
from normal(0, 0.02) weights, which on these CPUs did not learn to copy (see the demo's README section).

The module is ``fold.spec_decode.drafter.Drafter`` (what ``spec_decode.load_drafter`` builds); this script only
adds a parallel training forward: many blocks per sequence, each ``[token at a, MASK x (B-1)]``
reading the target features of entries ``< a`` and its own block (bidirectional), labels = the
target's greedy tokens at the masked slots (positions ``a+1 .. a+B-1``). The target (its embedding
and LM head too) is frozen, so its features are computed once per sequence into a pool
(``--pool`` sequences, ``--refresh`` of them replaced by new ones every step): a step costs the
drafter alone.

Copying: the data mix is mostly documents where copying is the only way to predict (``--mix``);
a slot whose answer continues an earlier occurrence of the two tokens before it (``tokens.copy_mask``)
weighs ``1 + --copy-weight`` in the loss, slot ``k`` also ``--decay ** (k - 1)``, and
``--copy-anchors`` of the blocks start where the next token is such a copy.

Positions: true positions by default (as real drafters are trained, on short sequences). With
``--anchor-offset``, LongSpec's anchor-offset indices: the first ``--sinks`` positions are kept and
every later one is shifted by one random offset per sequence in ``[0, --max-offset]``.

Writes a z-lab DFlash directory (``config.json`` with ``DFlashDraftModel`` and ``dflash_config``,
``model.safetensors`` in bfloat16) and ``train_log.json`` (device, threads, wall time, loss curve,
copy ability at the training length); then loads it back through ``spec_decode.load_drafter`` and checks
that the loaded module reproduces the training forward.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import fold
import fold.demo  # noqa: F401  (registers the fold_toy target)
from fold import spec_decode
from fold.demo import corpus, documents, prompts, tokens
from fold.files import write_safetensors_atomically, write_text_atomically
from fold.spec_decode import load_drafter
from fold.spec_decode.drafter import Drafter, DrafterConfig
from fold.spec_decode.loading import read_config
from fold.spec_decode.policies import plain_read
from examples.drafter_init import copy_circuit_init
from examples.train_target import MIX_HELP, check_device, check_mix, positive


def weighted_step(logits, labels, w, opt, params) -> torch.Tensor:
    """One optimizer step on the slot-weighted cross-entropy (``w`` per slot, like ``labels``),
    gradients clipped to norm 1; returns the loss."""
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    loss = (ce * w).sum() / w.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss


def chain_tau(logits, labels):
    """``(right, tau)``: which slots are argmax-right, and the train tau of a greedy chain
    (1 + the accepted prefix of the drafts, averaged over blocks)."""
    right = logits.argmax(-1) == labels
    return right, right.int().cumprod(-1).sum(-1).float().mean().item() + 1


def drafter_config(target_config, args) -> dict:
    """The z-lab DFlash ``config.json`` of the drafter."""
    return dict(model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=target_config.hidden_size,
                intermediate_size=3 * target_config.hidden_size, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                head_dim=args.head_dim or target_config.hidden_size // args.heads, rms_norm_eps=1e-6, attention_bias=False,
                hidden_act="silu", vocab_size=target_config.vocab_size, max_position_embeddings=262144,
                num_target_layers=target_config.num_hidden_layers,
                rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                dflash_config=dict(block_size=args.block_size, target_layer_ids=args.taps,
                                   mask_token_id=target_config.mask_token_id),
                fold_training=dict(seq_len=args.seq_len, anchor_offset=args.anchor_offset,
                                   max_offset=args.max_offset if args.anchor_offset else 0))


def _rope(x, pos, inv_freq):
    # x [B, T, H, d], pos [B, T] -> rotate-half RoPE at those positions
    work = torch.float64 if x.dtype == torch.float64 else torch.float32        # float64: a checking run
    angle = pos[..., None].to(work) * inv_freq.to(work)                         # [B, T, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, :, None], torch.cat([angle.sin()] * 2, -1)[:, :, None]
    half = x.shape[-1] // 2
    return x * cos.to(x.dtype) + torch.cat([-x[..., half:], x[..., :half]], -1) * sin.to(x.dtype)


def block_logits(drafter: Drafter, features, ids, anchors, positions, head=None, fold_read=None):
    """The parallel training forward.

    features [B, T, k*H] target taps; ids [B, T]; anchors [B, K] (block k covers a_k .. a_k + bs - 1
    and reads context entries < a_k); positions [B, T + bs] (the position of every entry, also past T)
    -> logits [B, K, bs - 1, vocab] of the drafting slots. ``head`` (default ``drafter.head``) maps the
    final normed hidden states to logits (a training script may score a part of the vocabulary).
    ``fold_read`` None reads every entry at its position (the plain read); ``(W, alpha)`` reads as
    ``fold.attention(window=W, alpha=alpha)`` does at inference (:func:`fold_block_attention`).
    """
    cfg = drafter.cfg
    bsz, n_ctx = ids.shape
    n_blk, bs = anchors.shape[1], cfg.block_size
    inv_freq = cfg.rope.inv_freq_on(ids.device)
    c = drafter.hidden_norm(drafter.fc(features))                               # [B, T, H]
    block = torch.full((bsz, n_blk, bs), cfg.mask_token_id, device=ids.device)
    block[:, :, 0] = ids.gather(1, anchors)
    slot_pos = positions.gather(1, (anchors[:, :, None] + torch.arange(bs, device=ids.device)).flatten(1))
    h = drafter.embed(block.flatten(1))                                         # [B, K*bs, H]
    q_blk = torch.arange(n_blk, device=ids.device).repeat_interleave(bs)        # block of each query row
    ctx_ok = torch.arange(n_ctx, device=ids.device)[None, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]
    blk_ok = (q_blk[:, None] == q_blk[None, :]).expand(bsz, -1, -1)
    allowed = torch.cat([ctx_ok, blk_ok], dim=2)[:, None]                       # [B, 1, K*bs, T + K*bs]
    ctx_pos = positions[:, :n_ctx]
    if fold_read is not None:                    # context entries D = W + bs or more before a row are far
        window, alpha = fold_read
        far = ctx_ok & (slot_pos[:, :, None] - ctx_pos[:, None, :] >= window + bs)          # [B, K*bs, T]
        allowed = torch.cat([ctx_ok & ~far, blk_ok], dim=2)[:, None]
        far_pos = (window + bs + torch.arange(bs, device=ids.device)).repeat(n_blk)[None].expand(bsz, -1)
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        k_ctx, v_ctx = attn.kv(c)                                               # [B, T, Hkv, d]
        k_blk, v_blk = attn.kv(x)
        q_pre = attn.q(x)
        q = _rope(q_pre, slot_pos, inv_freq)
        k = torch.cat([_rope(k_ctx, ctx_pos, inv_freq), _rope(k_blk, slot_pos, inv_freq)], 1)
        v = torch.cat([v_ctx, v_blk], 1)
        if fold_read is None:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=allowed, enable_gqa=True)  # [B, Hq, K*bs, d]
        else:
            o = fold_block_attention(q, k, v, _rope(q_pre, far_pos, inv_freq),
                                     _rope(k_ctx, torch.zeros_like(ctx_pos), inv_freq), allowed[:, 0], far, alpha)
        h = h + attn.o_proj(o.transpose(1, 2).flatten(2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = (head or drafter.head)(drafter.norm(h)).view(bsz, n_blk, bs, -1)
    return logits[:, :, 1:]


def fold_block_attention(q, k, v, q_far, k_far, near, far, alpha: float):
    """FOLD's read of many blocks at once, differentiable: the window branch (``q``, ``k`` rotated at their
    positions; ``near`` [B, Q, T + Q] what each row reads there) and the far branch (``q_far`` rotated at
    ``D + r``, ``k_far`` [B, T, Hkv, d] the context keys at the shared position; ``far`` [B, Q, T]),
    normalized apart and merged by their masses ``(Z_N o_N + Z_F o_F) / (Z_N + Z_F)`` with
    ``log Z_F = LSE(alpha * far logits) / alpha``. That is one softmax over the window's logits and the
    far logits ``alpha * s - (1 - 1/alpha) * LSE(alpha * s)``, which is how it is computed.
    q, q_far [B, Q, Hq, d]; k, v [B, T + Q, Hkv, d] -> [B, Hq, Q, d] (as SDPA's output)."""
    group = q.shape[2] // k.shape[2]
    n_ctx = k_far.shape[1]
    scale = q.shape[-1] ** -0.5
    keys, values = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s_near = torch.einsum("bqhd,bkhd->bhqk", q, keys) * scale                   # [B, Hq, Q, T + Q]
    s_near = s_near.masked_fill(~near[:, None], float("-inf"))
    s_far = torch.einsum("bqhd,bkhd->bhqk", q_far, k_far.repeat_interleave(group, 2)) * (scale * alpha)
    s_far = s_far.masked_fill(~far[:, None], float("-inf"))                      # [B, Hq, Q, T]
    has_far = far[:, None].any(-1, keepdim=True)
    lse = torch.logsumexp(s_far.masked_fill(~has_far, 0.0), -1, keepdim=True)
    s_far = s_far - (1 - 1 / alpha) * lse
    logits = torch.cat([torch.where(far[:, None], s_far, s_near[..., :n_ctx]), s_near[..., n_ctx:]], -1)
    return torch.softmax(logits, -1) @ values.transpose(1, 2)


def sample_positions(rng: random.Random, batch: int, length: int, anchor_offset: bool, sinks: int, max_offset: int):
    pos = torch.arange(length)[None].repeat(batch, 1)
    if anchor_offset:
        for b in range(batch):
            pos[b, sinks:] += rng.randint(0, max_offset)
    return pos


class FeaturePool:
    """Training sequences with the frozen target's features and greedy tokens, computed once each.

    Holds ``size`` sequences; :meth:`refresh` replaces ``n`` random ones with new sequences, so the
    data keep changing while a step mostly costs the drafter alone."""

    def __init__(self, target, drafter, tokenizer, code, args, rng):
        self.target, self.drafter, self.tokenizer, self.code, self.args, self.rng = \
            target, drafter, tokenizer, code, args, rng
        self.ids = self.features = self.greedy = self.copy = None
        self.size = args.pool
        self._fill(range(self.size))

    @torch.no_grad()
    def compute(self, n: int):
        """``n`` new sequences -> (ids [n, T], features [n, T, k*H] bf16, greedy [n, T], copy [n, T])."""
        a = self.args
        ids = torch.tensor([documents.training_sample(self.rng, self.tokenizer, self.code, a.seq_len, a.mix)
                            for _ in range(n)], device=a.device)
        with torch.autocast(a.device.type, dtype=torch.bfloat16):
            out = self.target(ids, output_hidden_states=True)
        features = self.drafter.features(out.hidden_states).to(torch.bfloat16)
        return ids, features, out.logits.argmax(-1), tokens.copy_mask(ids.cpu()).to(a.device)

    def _fill(self, rows):
        rows = list(rows)
        for lo in range(0, len(rows), 16):
            part = rows[lo:lo + 16]
            ids, features, greedy, copy = self.compute(len(part))
            if self.ids is None:
                shape = lambda x: (self.size, *x.shape[1:])  # noqa: E731
                self.ids, self.features = ids.new_empty(shape(ids)), features.new_empty(shape(features))
                self.greedy, self.copy = greedy.new_empty(shape(greedy)), copy.new_empty(shape(copy))
            idx = torch.tensor(part, device=ids.device)
            self.ids[idx], self.features[idx], self.greedy[idx], self.copy[idx] = ids, features, greedy, copy

    def refresh(self, n: int):
        if n:
            self._fill(self.rng.sample(range(self.size), n))

    def batch(self, n: int):
        idx = torch.tensor(self.rng.sample(range(self.size), n), device=self.ids.device)
        return self.ids[idx], self.features[idx].float(), self.greedy[idx], self.copy[idx]


def choose_anchors(rng: random.Random, copy_row: torch.Tensor, args) -> list[int]:
    """``--blocks`` distinct anchors in ``[min_context, T - bs]``; a share ``--copy-anchors`` of them
    where the next token is a copy (when the row has such places)."""
    lo, hi = args.min_context, args.seq_len - args.block_size
    at_copy = [a for a in (copy_row[lo + 1:hi + 2].nonzero().flatten() + lo).tolist() if a <= hi]
    n_copy = min(len(at_copy), round(args.blocks * args.copy_anchors))
    chosen = set(rng.sample(at_copy, n_copy))
    rest = [a for a in range(lo, hi + 1) if a not in chosen]
    chosen.update(rng.sample(rest, args.blocks - len(chosen)))
    return sorted(chosen)


def step_inputs(pool: FeaturePool, rng: random.Random, args):
    ids, features, greedy, copy = pool.batch(args.batch)
    anchors = torch.tensor([choose_anchors(rng, copy[b].cpu(), args) for b in range(args.batch)], device=ids.device)
    bs = args.block_size
    # slot i of block a predicts the token at a + i: the target's greedy choice after entry a + i - 1
    cols = (anchors[:, :, None] + torch.arange(bs - 1, device=ids.device)).flatten(1)
    labels = greedy.gather(1, cols).view(args.batch, args.blocks, bs - 1)
    is_copy = copy.gather(1, cols + 1).view(args.batch, args.blocks, bs - 1)
    positions = sample_positions(rng, args.batch, args.seq_len + bs, args.anchor_offset, args.sinks,
                                 args.max_offset).to(ids.device)
    return ids, features, anchors, labels, is_copy, positions


@torch.no_grad()
def copy_ability(target, drafter, tokenizer, code, args, n: int = 8, seed: int = 99) -> dict:
    """Copy ability at the training length, before any long-context run.

    - ``slot_accuracy_on_copies``: per slot, the share of copy positions (``tokens.copy_mask``) whose
      draft equals the target's greedy token, in the training forward on fresh sequences;
    - ``retrieval_tau``: ``spec_decode.generate``'s tau (policy ``dflash``, every entry at its true
      position) on retrieval prompts of the training length, the value stored at least half of it back.
    """
    rng = random.Random(seed)
    was_training = drafter.training
    drafter.eval()
    hits = torch.zeros(args.block_size - 1)
    counts = torch.zeros(args.block_size - 1)
    for _ in range(n):
        ids = torch.tensor([documents.training_sample(rng, tokenizer, code, args.seq_len, args.mix)],
                           device=args.device)
        out = target(ids, output_hidden_states=True)
        feats, greedy = drafter.features(out.hidden_states).float(), out.logits.argmax(-1)
        copy = tokens.copy_mask(ids.cpu())
        anchors = torch.arange(args.min_context, args.seq_len - args.block_size, device=args.device)[None]
        pos = torch.arange(args.seq_len + args.block_size, device=args.device)[None]
        pred = block_logits(drafter, feats, ids, anchors, pos).argmax(-1)[0].cpu()          # [K, bs-1]
        cols = (anchors[0, :, None].cpu() + torch.arange(args.block_size - 1))
        ok = pred == greedy[0].cpu()[cols]
        mask = copy[0][cols + 1]
        hits += (ok & mask).sum(0)
        counts += mask.sum(0)
    taus = []
    for _ in range(n):
        prompt, answer = prompts.retrieval_prompt(rng, tokenizer, args.seq_len, args.seq_len // 2)
        res = spec_decode.generate(target, drafter, torch.tensor([prompt], device=args.device), max_new_tokens=len(answer),
                            policy="dflash")
        taus.append(res.tau)
    drafter.train(was_training)
    return dict(slot_accuracy_on_copies=[round(float(h / max(c, 1)), 3) for h, c in zip(hits, counts)],
                copy_positions=int(counts[0]), retrieval_tau=round(sum(taus) / len(taus), 3))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=positive(float), default=22.0)
    ap.add_argument("--max-steps", type=positive(int), default=None)
    ap.add_argument("--seq-len", type=positive(int), default=256, help="tokens per training sequence")
    ap.add_argument("--batch", type=positive(int), default=8)
    ap.add_argument("--blocks", type=positive(int), default=8, help="blocks (anchors) per sequence")
    ap.add_argument("--min-context", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=positive(int), default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64, help="per head (0: hidden size / heads)")
    ap.add_argument("--taps", type=int, nargs="+", default=[0, 2], help="target layers whose outputs the drafter reads")
    ap.add_argument("--rope-theta", type=positive(float), default=1e6)
    ap.add_argument("--init", choices=("copy", "random"), default="copy",
                    help="copy: start from the copy circuit of examples/drafter_init.py (needs a target with a "
                         "context channel); random: normal(0, 0.02)")
    ap.add_argument("--lr", type=positive(float), default=5e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--decay", type=positive(float), default=0.9, help="loss weight decay per slot")
    ap.add_argument("--copy-weight", type=float, default=2.0, help="extra loss weight of a slot whose answer is a copy")
    ap.add_argument("--copy-anchors", type=float, default=0.5, help="share of blocks starting before a copy")
    ap.add_argument("--mix", type=float, nargs=len(documents.DOCUMENT_KINDS), default=[0.3, 0.3, 0.2, 0.2],
                    help=MIX_HELP)
    ap.add_argument("--pool", type=positive(int), default=2048, help="training sequences held with their features")
    ap.add_argument("--refresh", type=int, default=2, help="pool sequences replaced by new ones every step")
    ap.add_argument("--anchor-offset", action="store_true")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--max-offset", type=int, default=32768)
    ap.add_argument("--eval-every", type=int, default=0, help="measure copy ability every this many steps (0: at the end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the same code runs on both)")
    ap.add_argument("--threads", type=positive(int), default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--stdlib", type=Path, default=None)
    args = ap.parse_args(argv)
    check_mix(ap, args.mix)
    args.device = check_device(ap, args.device)
    if not (args.target / "config.json").is_file():
        ap.error(f"--target {args.target} is not a model directory (no config.json)")
    if args.block_size < 2:
        ap.error(f"--block-size must be >= 2 (the anchor and at least one draft), got {args.block_size}")
    if args.heads < 2 or args.heads % 2:
        ap.error(f"--heads must be even (heads_kv = heads / 2), got {args.heads}")
    for name in ("min_context", "sinks", "max_offset", "refresh", "eval_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.weight_decay < 0:
        ap.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.copy_weight < 0 or not 0 <= args.copy_anchors <= 1:
        ap.error(f"--copy-weight must be >= 0 and --copy-anchors in [0, 1], got {args.copy_weight}, {args.copy_anchors}")
    room = args.seq_len - args.block_size - args.min_context + 1
    if room < args.blocks:
        ap.error(f"--blocks {args.blocks} do not fit: {room} anchors lie in [--min-context, --seq-len - --block-size]")
    if args.refresh > args.pool or args.batch > args.pool:
        ap.error(f"--refresh ({args.refresh}) and --batch ({args.batch}) must not exceed --pool ({args.pool})")
    return args


def load_target(args):
    """The frozen target of ``--target``, checked against ``--heads`` and ``--taps``."""
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(args.device).eval()
    if args.heads > 0 and target.config.hidden_size % args.heads:
        raise SystemExit(f"--heads {args.heads} must divide the target's hidden size {target.config.hidden_size}")
    bad = [t for t in args.taps if not 0 <= t < target.config.num_hidden_layers - 1]
    if bad:
        raise SystemExit(f"--taps {bad} out of range: the target has layers 0..{target.config.num_hidden_layers - 2} "
                         "to tap (not the last)")
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def new_drafter(args, target) -> Drafter:
    """A drafter for ``target`` with N(0, 0.02) linear weights; its config.json written into ``--out``."""
    args.out.mkdir(parents=True, exist_ok=True)
    config = drafter_config(target.config, args)
    write_text_atomically(args.out / "config.json", json.dumps(config, indent=1))
    cfg: DrafterConfig = read_config(args.out, target.config)
    drafter = Drafter(cfg).to(args.device)
    drafter.bind(target)
    drafter.apply(lambda m: torch.nn.init.normal_(m.weight, std=0.02) if isinstance(m, torch.nn.Linear) else None)
    return drafter


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = load_target(args)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    code, _ = corpus.split_corpus(args.stdlib)
    drafter = new_drafter(args, target)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    weights = args.decay ** torch.arange(args.block_size - 1, dtype=torch.float32, device=args.device)
    log = dict(args={k: str(v) for k, v in vars(args).items()}, device=str(args.device),
               device_name=(torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"),
               threads=torch.get_num_threads(), params=sum(p.numel() for p in params), steps=[], evals=[])
    print(f"drafter: {log['params'] / 1e6:.2f}M parameters, block {args.block_size}, taps {args.taps}, "
          f"{'anchor-offset' if args.anchor_offset else 'true'} positions, on {args.device}")
    t_pool = time.perf_counter()
    pool = FeaturePool(target, drafter, tokenizer, code, args, random.Random(args.seed + 1))
    log["pool_seconds"] = round(time.perf_counter() - t_pool, 1)
    print(f"feature pool: {args.pool} sequences in {log['pool_seconds']:.0f} s", flush=True)
    if args.init == "copy":
        n = min(args.pool, 48)
        samples = (pool.features[:n].flatten(0, 1).float().cpu(), pool.ids[:n].flatten().cpu())
        log["copy_init"] = copy_circuit_init(drafter.cpu(), target.config, samples)
        drafter.to(args.device)
        log["copy_ability_at_init"] = copy_ability(target, drafter, tokenizer, code, args)
        print("copy circuit:", log["copy_init"], "copy ability at init:", log["copy_ability_at_init"], flush=True)
    budget, t0, step = args.minutes * 60, time.perf_counter(), 0
    drafter.train()
    while True:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1 or (args.max_steps is not None and step >= args.max_steps):
            break
        if args.max_steps is not None:
            frac = max(frac, step / args.max_steps)
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * frac))
        pool.refresh(args.refresh)
        ids, features, anchors, labels, is_copy, positions = step_inputs(pool, rng, args)
        with torch.autocast(args.device.type, dtype=torch.bfloat16):
            logits = block_logits(drafter, features, ids, anchors, positions)
        loss = weighted_step(logits, labels, weights * (1 + args.copy_weight * is_copy.float()), opt, params)
        step += 1
        if step % 10 == 0 or step == 1:
            with torch.no_grad():
                right, tau = chain_tau(logits, labels)
                first_copy = right[..., 0][is_copy[..., 0]].float().mean().item() if is_copy[..., 0].any() else 0.0
            log["steps"].append(dict(step=step, seconds=round(time.perf_counter() - t0, 1), loss=round(loss.item(), 4),
                                     train_tau=round(tau, 3), first_slot_copy_acc=round(first_copy, 3)))
            print(f"step {step:5d}  {(time.perf_counter() - t0) / 60:5.1f} min  loss {loss.item():.3f}  "
                  f"train tau {tau:.2f}  first-slot copy acc {first_copy:.2f}", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            ev = dict(step=step, **copy_ability(target, drafter, tokenizer, code, args))
            log["evals"].append(ev)
            print("copy ability:", ev, flush=True)
    log["train_seconds"] = round(time.perf_counter() - t0, 1)
    log["total_steps"] = step
    drafter.eval()
    log["copy_ability"] = copy_ability(target, drafter, tokenizer, code, args)
    print("copy ability at the training length:", log["copy_ability"])
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    write_safetensors_atomically(args.out / "model.safetensors", state)
    log["load_check_max_abs_diff"] = check_loaded(args.out, target, tokenizer, rng, code, args)
    write_text_atomically(args.out / "train_log.json", json.dumps(log, indent=1))
    print(f"saved {args.out} (loaded back through spec_decode.load_drafter; "
          f"max |logit diff| vs the training forward {log['load_check_max_abs_diff']:.3g})")
    return log


@torch.no_grad()
def check_loaded(path, target, tokenizer, rng, code, args) -> float:
    """Load the directory through ``spec_decode.load_drafter`` and compare its inference path (the plain
    read) with the training forward of the same loaded (bf16-rounded) weights on one block."""
    loaded = load_drafter(path, target).float()
    n = max(args.seq_len, 2 * args.block_size + 2)
    ids = torch.tensor([documents.training_sample(rng, tokenizer, code, n, args.mix)], device=args.device)
    inference, training = slot_logits_both_ways(loaded, target, ids)
    return float((inference - training).abs().max())


@torch.no_grad()
def slot_logits_both_ways(drafter: Drafter, target, ids, fold_read=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot logits ``[bs - 1, vocab]`` of the block anchored at ``len(ids) - bs - 1``, by the inference
    path (context appended to the drafter's cache, the plain read or with ``fold_read`` ``(W, alpha)``
    ``fold.attention``'s) and by :func:`block_logits` (the same ``fold_read``), in the drafter's dtype."""
    n, bs, rope = ids.shape[1], drafter.cfg.block_size, drafter.cfg.rope
    features = drafter.features(target(ids, output_hidden_states=True).hidden_states)
    a = n - bs - 1
    state = drafter.new_state(n, ids.device, drafter.fc.weight.dtype)
    drafter.append_context(state, features[:, :a])
    if fold_read is None:
        read = lambda q, k, v, layer: plain_read(q, k, v, rope, "torch")        # noqa: E731
    else:
        read = lambda q, k, v, layer: fold.attention(q, k, v, window=fold_read[0], rope=rope,  # noqa: E731
                                                     alpha=fold_read[1], backend="torch")
    inference = drafter.slot_logits(state, int(ids[0, a]), read)
    training = block_logits(drafter, features, ids, torch.tensor([[a]], device=ids.device),
                            torch.arange(n + bs, device=ids.device)[None], fold_read=fold_read)
    return inference, training[0, 0]


if __name__ == "__main__":
    main()
