"""Tree verification: a token tree from the block drafter's per-slot candidates, verified in one
target forward with ``fold.tree_attention`` inside the target (registered through transformers'
``AttentionInterface``, no per-model patches), then the cache compacted to the accepted path.

A sliding-window layer of the target (window ``W``, counting the current token) keeps its window
for every node: node ``i`` at depth ``d_i`` (position ``committed + d_i``) sees the cached entries
at positions ``> committed + d_i - W`` and its ancestors at depth ``> d_i - W``. The entries every
node sees go through ``fold.tree_attention`` as its cache segment; the at most ``max depth``
oldest window entries that only shallower nodes see are one small masked read, merged by LSE
(``fold.merge_states``). Targets with linear-attention layers are refused (``_hf.check_target``).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

import fold
from fold.spec import _hf

_CURRENT = contextvars.ContextVar("fold_tree_verification", default=None)   # (tree_mask [1, T, T], depths [T])
_REGISTERED = False


def _edge_read(q, k, v, visible, scaling):
    """Explicit attention of ``q [1, T, Hq, d]`` over a few keys ``k, v [1, E, Hkv, d]`` with
    ``visible [T, E]`` -> ``(o [1, T, Hq, d], lse [1, T, Hq])``, natural log, float32 or float64."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("thd,ehd->hte", q[0].to(work), k[0].to(work).repeat_interleave(group, 1)) * scaling
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                                  # [Hq, T]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    o = torch.einsum("hte,ehd->thd", p, v[0].to(work).repeat_interleave(group, 1))
    return o[None].to(q.dtype), lse.transpose(0, 1)[None]


def _tree_attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                              sliding_window=None, **kwargs):
    # query [B, Hq, T, d]; key/value [B, Hkv, n_cache + T, d], rotated, the cached entries first
    mask, depths = _CURRENT.get()
    n_tree = query.shape[2]
    n_cache = key.shape[2] - n_tree
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if not sliding_window:
        out = fold.tree_attention(q, k[:, :n_cache], v[:, :n_cache], k[:, n_cache:], v[:, n_cache:], mask,
                                  softmax_scale=scaling)
        return out, None
    # cached entry c sits at distance n_cache - c from the root: node i sees it iff n_cache - c + d_i < W
    window, d_max = int(sliding_window), int(depths.max())
    lo = max(0, n_cache - window + 1)                       # the oldest entry the root sees
    shared = max(lo, n_cache - window + 1 + d_max)          # the oldest entry every node sees
    in_reach = (depths[:, None] - depths[None, :]) < window
    out, lse = fold.tree_attention(q, k[:, shared:n_cache], v[:, shared:n_cache], k[:, n_cache:], v[:, n_cache:],
                                   mask & in_reach[None], softmax_scale=scaling, return_lse=True)
    if shared > lo:
        c = torch.arange(lo, shared, device=q.device)
        visible = (n_cache - c[None, :] + depths[:, None]) < window                     # [T, shared - lo]
        o_edge, lse_edge = _edge_read(q, k[:, lo:shared], v[:, lo:shared], visible, scaling)
        out, _ = fold.merge_states([out, o_edge], [lse, lse_edge.to(lse.dtype)])
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
def tree_verification(target, tree_mask: torch.Tensor, committed: int | None = None, depths=None):
    """Within the block, the target's attention is ``fold.tree_attention`` over its cache + the tree.

    ``tree_mask [1, T, T]``; ``depths [T]`` of the nodes (the root at 0), needed by sliding-window
    layers (default: the number of ancestors, read off the mask). ``committed`` is not needed: each
    layer's cached entries are the keys before the ``T`` tree nodes (a sliding layer holds only
    its window)."""
    _register()
    if depths is None:
        depths = tree_mask[0].sum(-1) - 1
    depths = torch.as_tensor(depths, device=tree_mask.device)
    previous = target.config._attn_implementation
    token = _CURRENT.set((tree_mask, depths))
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
    with tree_verification(target, mask, depths=torch.tensor(depths, device=device)):
        logits, hidden_states, cache = _hf.forward(target, ids, cache, position_ids=positions)
    path, bonus = accept_path(tokens, parents, logits[0].argmax(-1).tolist())
    kept = [0] + path
    _hf.keep_tree_path(cache, len(tokens), kept)
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
