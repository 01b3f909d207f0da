"""Tree verification: a token tree from the block drafter's per-slot candidates, verified in one
target forward with ``fold.tree_attention`` inside the target (registered through transformers'
``AttentionInterface``, no per-model patches), then the cache compacted to the accepted path.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

import fold
from fold.spec import _hf

_CURRENT = contextvars.ContextVar("fold_tree_verification", default=None)   # (tree_mask [1, T, T], committed)
_REGISTERED = False


def _tree_attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query [B, Hq, T, d]; key/value [B, Hkv, committed + T, d], rotated, cache first
    mask, committed = _CURRENT.get()
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out = fold.tree_attention(q, k[:, :committed], v[:, :committed], k[:, committed:], v[:, committed:], mask,
                              softmax_scale=scaling)
    return out, None


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register("fold_tree", _tree_attention_interface)
        AttentionMaskInterface.register("fold_tree", lambda *args, **kwargs: None)   # the tree mask is ours
        _REGISTERED = True


@contextlib.contextmanager
def tree_verification(target, tree_mask: torch.Tensor, committed: int):
    """Within the block, the target's attention is ``fold.tree_attention`` over its cache + the tree."""
    _register()
    previous = target.config._attn_implementation
    token = _CURRENT.set((tree_mask, committed))
    target.set_attn_implementation("fold_tree")
    try:
        yield
    finally:
        target.set_attn_implementation(previous)
        _CURRENT.reset(token)


def expand_level(tokens, parents, depths, scores, rows, width: int) -> list[int]:
    """Add one level: the ``width`` best children by cumulative log-probability over ``rows`` =
    ``[(parent node, logits over the vocab)]``; ties go to the earlier parent, then the lower token.
    Appends to ``tokens/parents/depths/scores`` in place and returns the new nodes."""
    candidates = []
    for node, row in rows:
        values, order = torch.sort(torch.log_softmax(row.float(), dim=-1), descending=True, stable=True)
        candidates += [(scores[node] + float(v), node, int(t)) for v, t in zip(values[:width], order[:width])]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    new = []
    for score, parent, tok in candidates[:width]:
        tokens.append(tok)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(score)
        new.append(len(tokens) - 1)
    return new


def build_tree(slot_logits: torch.Tensor, widths, anchor: int, markov_bias=None):
    """Level i keeps the ``widths[i]`` best paths by cumulative draft log-probability.

    ``slot_logits [n_slots, V]``; ``markov_bias(token) -> [V]`` adds DSpark's parent-dependent bias.
    Returns ``(tokens, parents, depths)`` in level order, node 0 being the anchor (the root).
    """
    tokens, parents, depths, scores = [anchor], [-1], [0], [0.0]
    frontier = [0]
    for level, width in enumerate(widths[:slot_logits.shape[0]]):
        rows = [(node, slot_logits[level] + (markov_bias(tokens[node]) if markov_bias is not None else 0))
                for node in frontier]
        frontier = expand_level(tokens, parents, depths, scores, rows, width)
    return tokens, parents, depths


def tree_mask(parents) -> torch.Tensor:
    """[T, T] bool: node i sees its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def accept_path(tokens, parents, target_argmax):
    """Greedy: follow the child whose token is the target's choice at its parent, from the root.

    Returns ``(path, bonus)``: accepted node indices (root excluded) and the target's next token."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    path, node = [], 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children.get(node, []) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


@torch.no_grad()
def verify_tree(target, cache, tokens, parents, depths, committed: int):
    """Verify a tree (node 0 = the anchor at position ``committed``) in one target forward, compact
    the cache to the accepted path. Returns ``(path, bonus, kept rows, hidden_states)``."""
    device = next(target.parameters()).device
    mask = tree_mask(parents).to(device)[None]
    ids = torch.tensor([tokens], device=device)
    positions = torch.tensor([depths], device=device) + committed
    with tree_verification(target, mask, committed):
        logits, hidden_states, cache = _hf.forward(target, ids, cache, position_ids=positions)
    path, bonus = accept_path(tokens, parents, logits[0].argmax(-1).tolist())
    kept = [0] + path
    _hf.keep(cache, torch.cat([torch.arange(committed), committed + torch.tensor(kept)]).to(device))
    return path, bonus, kept, hidden_states


@torch.no_grad()
def tree_round(target, drafter, state, cache, anchor: int, read, widths):
    """One block-drafter round: draft a tree, verify it, compact the cache, append the accepted features.

    Returns ``(accepted tokens incl. the target's, tree nodes drafted, the verification's hidden
    states, the row of the last accepted node in them)``.
    """
    logits = drafter.slot_logits(state, anchor, read)
    markov = drafter.markov_bias if drafter.cfg.markov_rank else None
    tokens, parents, depths = build_tree(logits, widths, anchor, markov)
    path, bonus, kept, hidden_states = verify_tree(target, cache, tokens, parents, depths, state.length)
    drafter.append_context(state, drafter.features(hidden_states)[:, kept])
    return [tokens[i] for i in path] + [bonus], len(tokens) - 1, hidden_states, kept[-1]
