"""Train a z-lab DFlash drafter for the demo target, through fold's own drafter module, on CPU.

    python examples/train_drafter.py --target fold/demo/artifacts/target --out fold/demo/artifacts/drafter
    python examples/train_drafter.py ... --anchor-offset --out fold/demo/artifacts/drafter_anchor

The module is ``fold.spec.drafter.Drafter`` (what ``spec.load_drafter`` builds); this script only
adds a parallel training forward: many blocks per sequence, each ``[token at a, MASK x (B-1)]``
reading the target features of entries ``< a`` and its own block (bidirectional), labels = the
target's greedy tokens at the masked slots (positions ``a+1 .. a+B-1``), slot weights
``decay ** (slot - 1)``. The target (its embedding and LM head too) is frozen.

Positions: true positions by default (as real drafters are trained, on short sequences). With
``--anchor-offset``, LongSpec's anchor-offset indices: the first ``--sinks`` positions are kept and
every later one is shifted by one random offset per sequence in ``[0, --max-offset]``.

Writes a z-lab DFlash directory (``config.json`` with ``DFlashDraftModel`` and ``dflash_config``,
``model.safetensors`` in bfloat16) and ``train_log.json``; then loads it back through
``spec.load_drafter`` and checks that the loaded module reproduces the training forward.
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
from safetensors.torch import save_file

import fold.demo  # noqa: F401  (registers the fold_toy target)
from fold.demo import data
from fold.spec import load_drafter
from fold.spec.drafter import Drafter, DrafterConfig
from fold.spec.loading import read_config
from fold.spec.policies import plain_read


def drafter_config(target_config, args) -> dict:
    """The z-lab DFlash ``config.json`` of the drafter."""
    return dict(model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=target_config.hidden_size,
                intermediate_size=3 * target_config.hidden_size, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                head_dim=target_config.hidden_size // args.heads, rms_norm_eps=1e-6, attention_bias=False,
                hidden_act="silu", vocab_size=target_config.vocab_size, max_position_embeddings=262144,
                num_target_layers=target_config.num_hidden_layers,
                rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                dflash_config=dict(block_size=args.block_size, target_layer_ids=args.taps,
                                   mask_token_id=target_config.mask_token_id),
                fold_training=dict(seq_len=args.seq_len, anchor_offset=args.anchor_offset,
                                   max_offset=args.max_offset if args.anchor_offset else 0))


def _rope(x, pos, inv_freq):
    # x [B, T, H, d], pos [B, T] -> rotate-half RoPE at those positions
    angle = pos[..., None].float() * inv_freq                                   # [B, T, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, :, None], torch.cat([angle.sin()] * 2, -1)[:, :, None]
    half = x.shape[-1] // 2
    return x * cos.to(x.dtype) + torch.cat([-x[..., half:], x[..., :half]], -1) * sin.to(x.dtype)


def block_logits(drafter: Drafter, features, ids, anchors, positions):
    """The parallel training forward.

    features [B, T, k*H] target taps; ids [B, T]; anchors [B, K] (block k covers a_k .. a_k + bs - 1
    and reads context entries < a_k); positions [B, T + bs] (the position of every entry, also past T)
    -> logits [B, K, bs - 1, vocab] of the drafting slots.
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
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        k_ctx, v_ctx = attn.kv(c)                                               # [B, T, Hkv, d]
        k_blk, v_blk = attn.kv(x)
        q = _rope(attn.q(x), slot_pos, inv_freq)
        k = torch.cat([_rope(k_ctx, ctx_pos, inv_freq), _rope(k_blk, slot_pos, inv_freq)], 1)
        v = torch.cat([v_ctx, v_blk], 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=allowed, enable_gqa=True)  # [B, Hq, K*bs, d]
        h = h + attn.o_proj(o.transpose(1, 2).flatten(2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = drafter.head(drafter.norm(h)).view(bsz, n_blk, bs, -1)
    return logits[:, :, 1:]


def sample_positions(rng: random.Random, batch: int, length: int, anchor_offset: bool, sinks: int, max_offset: int):
    pos = torch.arange(length)[None].repeat(batch, 1)
    if anchor_offset:
        for b in range(batch):
            pos[b, sinks:] += rng.randint(0, max_offset)
    return pos


def train_step_inputs(target, drafter, rng, code, args):
    ids = torch.tensor([list(data.training_sample(rng, code, args.seq_len, tuple(args.mix)))
                        for _ in range(args.batch)])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        features = drafter.features(out.hidden_states).float()
        greedy = out.logits.argmax(-1)                                          # target's token after each entry
    bs = args.block_size
    anchors = torch.stack([torch.tensor(sorted(rng.sample(range(args.min_context, args.seq_len - bs + 1),
                                                          args.blocks))) for _ in range(args.batch)])
    # slot i of block a predicts the token at a + i: the target's greedy choice after entry a + i - 1
    labels = greedy.gather(1, (anchors[:, :, None] + torch.arange(bs - 1)).flatten(1))
    labels = labels.view(args.batch, args.blocks, bs - 1)
    positions = sample_positions(rng, args.batch, args.seq_len + bs, args.anchor_offset, args.sinks, args.max_offset)
    return ids, features, anchors, labels, positions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=48, help="blocks (anchors) per sequence")
    ap.add_argument("--min-context", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--taps", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--decay", type=float, default=0.9, help="loss weight decay per slot")
    ap.add_argument("--mix", type=float, nargs=3, default=[0.4, 0.4, 0.2],
                    help="shares of code, key-value and repeated-line windows (copying needs the latter two)")
    ap.add_argument("--anchor-offset", action="store_true")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--max-offset", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--stdlib", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    code, _ = data.split_corpus(args.stdlib)
    args.out.mkdir(parents=True, exist_ok=True)
    config = drafter_config(target.config, args)
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    cfg: DrafterConfig = read_config(args.out, target.config)
    drafter = Drafter(cfg)
    drafter.bind(target)
    drafter.apply(lambda m: torch.nn.init.normal_(m.weight, std=0.02) if isinstance(m, torch.nn.Linear) else None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    weights = args.decay ** torch.arange(args.block_size - 1, dtype=torch.float32)
    log = dict(args={k: str(v) for k, v in vars(args).items()}, params=sum(p.numel() for p in params), steps=[])
    print(f"drafter: {log['params'] / 1e6:.2f}M parameters, block {args.block_size}, taps {args.taps}, "
          f"{'anchor-offset' if args.anchor_offset else 'true'} positions")
    budget, t0, step = args.minutes * 60, time.perf_counter(), 0
    drafter.train()
    while True:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1 or (args.max_steps is not None and step >= args.max_steps):
            break
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * frac))
        ids, features, anchors, labels, positions = train_step_inputs(target, drafter, rng, code, args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = block_logits(drafter, features, ids, anchors, positions)
        ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        loss = (ce * weights).sum(-1).mean() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            with torch.no_grad():     # train tau of a greedy chain: 1 + accepted prefix of the drafts
                ok = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1).float().mean().item() + 1
            log["steps"].append(dict(step=step, seconds=round(time.perf_counter() - t0, 1), loss=round(loss.item(), 4),
                                     train_tau=round(ok, 3)))
            print(f"step {step:5d}  {(time.perf_counter() - t0) / 60:5.1f} min  loss {loss.item():.3f}  "
                  f"train tau {ok:.2f}", flush=True)
    log["train_seconds"] = round(time.perf_counter() - t0, 1)
    log["total_steps"] = step
    drafter.eval()
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(args.out / "model.safetensors"))
    log["load_check_max_abs_diff"] = check_loaded(args.out, target, rng, code, args)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved {args.out} (loaded back through spec.load_drafter; "
          f"max |logit diff| vs the training forward {log['load_check_max_abs_diff']:.3g})")
    return log


@torch.no_grad()
def check_loaded(path, target, rng, code, args) -> float:
    """Load the directory through ``spec.load_drafter`` and compare its inference path (the plain
    read) with the training forward of the same loaded (bf16-rounded) weights on one block."""
    loaded = load_drafter(path, target).float()
    ids = torch.tensor([list(data.training_sample(rng, code, 256))])
    out = target(ids, output_hidden_states=True)
    features = loaded.features(out.hidden_states)
    a = 200
    state = loaded.new_state(256, ids.device, torch.float32)
    loaded.append_context(state, features[:, :a])
    inference = loaded.slot_logits(state, int(ids[0, a]),
                                   lambda q, k, v, layer: plain_read(q, k, v, loaded.cfg.rope, "torch"))
    training = block_logits(loaded, features, ids, torch.tensor([[a]]), torch.arange(256 + args.block_size)[None])
    return float((inference - training[0, 0]).abs().max())


if __name__ == "__main__":
    main()
