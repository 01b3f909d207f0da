"""What a DFlash drafter for the real pair can read from its target's features, and whether it copies.

A block drafter reads context entry ``j`` only through a linear map of the tapped hidden states at
``j`` (``fc``, a norm, then each layer's ``k_proj``/``v_proj``). Copying the token after an earlier
occurrence of the anchor, from anywhere in the context (FOLD's far memory has no positions), needs
the key of entry ``j`` to say which token stood ``d`` places before it. Two measurements, on the
feature caches of ``examples/train_real_drafter.py``:

``lags``: a ridge probe from the taps at ``t`` to the target's embedding of the token at ``t - d``,
scored by the nearest embedding row (top-1 over the whole vocabulary) on held-back sequences::

    python -m examples.inspect_real_features lags --cache ~/.cache/fold/real-features --shards 4

``layers``: the same probe from each hidden state of the target alone (``hidden_states[i]``, the
embedding at 0, layer ``i - 1``'s output after it; a DFlash tap ``t`` is entry ``t + 1``), run on a
cache's token ids, for choosing taps::

    python -m examples.inspect_real_features layers --cache ~/.cache/fold/real-features --shards 2

``copy``: a drafter's per-slot accuracy (its argmax equal to the target's greedy token) on a shard,
split by whether the slot's token continues a copy of an earlier span (``fold.demo.tokens.copy_mask``)
inside a run of >= 4 copied tokens, a shorter run, or no copy::

    python -m examples.inspect_real_features copy --drafter DIR --shard FILE

(``--shard`` is best one the drafter never saw: ``train_real_drafter.py extract --form FORM --cache NEW
--seed 1 --max-shards 1`` writes one of a training form.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from examples.train_drafter import block_logits
from examples.train_real_drafter import existing_shards


def lag_probe(features: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor, lags, *, train_rows: int,
              ridge: float = 1.0) -> dict[int, float]:
    """Top-1 accuracy of a ridge probe from ``features [N, T, F]`` at ``t`` to ``embed[ids[:, t - d]]``,
    fitted on the first ``train_rows`` sequences and scored on the rest; ``embed [V, H]``; ``lags``:
    the ``d`` to probe. Features are scaled to unit RMS per position (the drafter's norm does so too)."""
    x = features.double()
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    unit = embed.double() / embed.double().norm(dim=-1, keepdim=True).clamp_min(1e-12)
    out = {}
    for d in lags:
        xs, ys = x[:, d:], ids[:, :ids.shape[1] - d]
        a, b = xs[:train_rows].flatten(0, 1), embed.double()[ys[:train_rows].flatten()]
        w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=a.dtype), a.T @ b)
        pred = (xs[train_rows:].flatten(0, 1) @ w @ unit.T).argmax(-1)
        out[d] = round(float((pred == ys[train_rows:].flatten()).double().mean()), 4)
    return out


@torch.no_grad()
def layer_probe(target, ids: torch.Tensor, lags, *, train_rows: int, batch: int = 4) -> list[dict[int, float]]:
    """:func:`lag_probe` from each entry of ``target``'s ``hidden_states`` on ``ids [N, T]``, one dict
    per entry (the embedding first)."""
    states = []
    for lo in range(0, len(ids), batch):
        out = target(ids[lo:lo + batch], output_hidden_states=True)
        states.append(torch.stack([h.float() for h in out.hidden_states]))          # [layers + 1, b, T, H]
    states = torch.cat(states, 1)
    embed = target.get_input_embeddings().weight.detach()
    return [lag_probe(h, ids, embed, lags, train_rows=train_rows) for h in states]


@torch.no_grad()
def copy_accuracy(drafter, features, ids, greedy, copy, *, stride: int = 7, long_run: int = 4,
                  min_context: int = 16) -> dict:
    """Per-slot argmax accuracy of ``drafter`` against the target's greedy tokens, blocks anchored every
    ``stride`` entries from ``min_context``; ``features [N, T, F]`` (the drafter's taps), ``ids``,
    ``greedy``, ``copy [N, T]``. Returns ``{"long_copy"|"short_copy"|"no_copy": [right, count],
    "slots": [[right, count] per slot]}``."""
    bs = drafter.cfg.block_size
    n, t = ids.shape
    run = torch.zeros_like(ids)                           # length of the copied run ending at each entry
    for col in range(t):
        run[:, col] = torch.where(copy[:, col], (run[:, col - 1] if col else 0) + 1, 0)
    anchors = torch.arange(min_context, t - bs, stride)[None]
    cols = anchors[0][:, None] + torch.arange(bs - 1)     # slot i of block a: the token after entry a + i
    out = {"long_copy": [0, 0], "short_copy": [0, 0], "no_copy": [0, 0], "slots": [[0, 0] for _ in range(bs - 1)]}
    for b in range(n):
        logits = block_logits(drafter, features[b:b + 1].float(), ids[b:b + 1], anchors, torch.arange(t + bs)[None])
        right = logits[0].argmax(-1) == greedy[b][cols]
        copied, length = copy[b][cols + 1], run[b][cols + 1]
        for kind, m in (("long_copy", copied & (length >= long_run)), ("short_copy", copied & (length < long_run)),
                        ("no_copy", ~copied)):
            out[kind][0] += int(right[m].sum())
            out[kind][1] += int(m.sum())
        for i in range(bs - 1):
            out["slots"][i][0] += int(right[:, i].sum())
            out["slots"][i][1] += right.shape[0]
    return out


def _share(pair) -> str:
    return f"{pair[0] / max(1, pair[1]):.3f} of {pair[1]}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    lp = sub.add_parser("lags", help="ridge probes of the tokens at lags 0..5 from the cached taps")
    lp.add_argument("--cache", type=Path, required=True)
    lp.add_argument("--shards", type=int, default=4, help="shards read (the last quarter of their sequences scores)")
    lp.add_argument("--target", type=Path, default=None)
    yp = sub.add_parser("layers", help="the lag probe from each hidden state of the target, on a cache's ids")
    yp.add_argument("--cache", type=Path, required=True)
    yp.add_argument("--shards", type=int, default=2, help="shards whose ids are run (the last quarter scores)")
    yp.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    yp.add_argument("--target", type=Path, default=None)
    cp = sub.add_parser("copy", help="a drafter's accuracy on copied and other tokens of one shard")
    cp.add_argument("--drafter", type=Path, required=True)
    cp.add_argument("--shard", type=Path, required=True)
    cp.add_argument("--target", type=Path, default=None)
    args = ap.parse_args(argv)
    from fold import spec_decode
    from fold.demo import real

    target, _ = real.load_target(args.target)
    if args.stage == "lags":
        parts = [load_file(str(p)) for p in existing_shards(args.cache)[:args.shards]]
        ids = torch.cat([p["ids"] for p in parts]).long()
        feats = torch.cat([p["features"] for p in parts]).float()
        embed = target.get_input_embeddings().weight.detach()
        print(f"{len(ids)} sequences of {ids.shape[1]} tokens; top-1 over {embed.shape[0]} tokens by lag:",
              lag_probe(feats, ids, embed, range(6), train_rows=len(ids) * 3 // 4))
        return
    if args.stage == "layers":
        ids = torch.cat([load_file(str(p))["ids"] for p in existing_shards(args.cache)[:args.shards]]).long()
        print(f"{len(ids)} sequences of {ids.shape[1]} tokens; top-1 by lag from hidden_states[i] "
              "(0: the embedding; DFlash tap t is entry t + 1):")
        for i, res in enumerate(layer_probe(target, ids, args.lags, train_rows=len(ids) * 3 // 4)):
            print(f"  {i:3d}  " + "  ".join(f"lag {d}: {a:.3f}" for d, a in res.items()), flush=True)
        return
    drafter = spec_decode.load_drafter(args.drafter, target).float()
    part = load_file(str(args.shard))
    res = copy_accuracy(drafter, part["features"], part["ids"].long(), part["greedy"].long(), part["copy"].bool())
    print(f"{args.drafter} on {args.shard}: long copies {_share(res['long_copy'])}, short copies "
          f"{_share(res['short_copy'])}, no copy {_share(res['no_copy'])}; per slot "
          + ", ".join(f"{a / max(1, n):.3f}" for a, n in res["slots"]))


if __name__ == "__main__":
    main()
