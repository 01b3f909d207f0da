"""Tree verification: a token tree from the block drafter's per-slot candidates, verified in one
target forward with ``fold.tree_attention`` inside the target (registered through transformers'
``AttentionInterface``, no per-model patches), then the cache compacted to the accepted path.

A sliding-window layer of the target (window ``W``, counting the current token) keeps its window
for every node: node ``i`` at depth ``d_i`` (position ``committed + d_i``) sees the cached entries
at positions ``> committed + d_i - W`` and its ancestors at depth ``> d_i - W``. The entries every
node sees go through ``fold.tree_attention`` as its cache segment; the at most ``max depth``
oldest window entries that only shallower nodes see are one small masked read, merged by LSE
(``fold.merge_states``). Targets with linear-attention layers are refused
(``fold.spec_decode.target.check_target``).
"""

from __future__ import annotations

import torch

import fold
from fold.masked import masked_attention
from fold.rope import work_dtype


def _edge_read(q, k, v, visible, scaling):
    """Explicit attention of ``q [1, T, Hq, d]`` over a few keys ``k, v [1, E, Hkv, d]`` with
    ``visible [T, E]`` -> ``(o [1, T, Hq, d], lse [1, T, Hq])``, natural log, float32 or float64."""
    work = work_dtype(q.dtype)
    o, lse = masked_attention(q[0].transpose(0, 1).to(work), k[0].transpose(0, 1).to(work),
                              v[0].transpose(0, 1).to(work), visible, scaling)
    return o.transpose(0, 1)[None].to(q.dtype), lse.transpose(0, 1)[None]


def tree_read(tree_mask: torch.Tensor, depths: torch.Tensor):
    """The target's attention during a tree verification, for :meth:`TargetSession.attention`:
    ``fold.tree_attention`` over each layer's cached entries + the ``T`` tree nodes under
    ``tree_mask [1, T, T]``; a sliding-window layer keeps each node's window by ``depths [T]``."""

    def read(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        # query [B, Hq, T, d]; key/value [B, Hkv, n_cache + T, d], rotated, the cached entries first
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return _tree_layer(q, k, v, tree_mask, depths, scaling, sliding_window), None
    return read


def _tree_layer(q, k, v, mask, depths, scaling, sliding_window):
    n_cache = k.shape[1] - q.shape[1]
    if not sliding_window:
        return fold.tree_attention(q, k[:, :n_cache], v[:, :n_cache], k[:, n_cache:], v[:, n_cache:], mask,
                                   softmax_scale=scaling)
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
    return out


def tree_verification(session, tree_mask: torch.Tensor, depths=None):
    """Within the block, ``session``'s target attention is :func:`tree_read` over its cache + the tree.

    ``tree_mask [1, T, T]``; ``depths [T]`` of the nodes (the root at 0), needed by sliding-window
    layers (default: the number of ancestors, read off the mask)."""
    if depths is None:
        depths = tree_mask[0].sum(-1) - 1
    return session.attention(tree_read(tree_mask, torch.as_tensor(depths, device=tree_mask.device)))


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
def verify_tree(session, tokens, parents, depths):
    """Verify a tree (node 0 = the anchor, at the session's next position) in one target forward,
    keep the accepted path. Returns ``(path, bonus, kept rows, hidden_states)``."""
    device = session.device
    mask = tree_mask(parents).to(device)[None]
    positions = torch.tensor(depths, device=device) + session.length
    with tree_verification(session, mask, depths=torch.tensor(depths, device=device)):
        logits, hidden_states = session.verify(tokens, position_ids=positions)
    path, bonus = accept_path(tokens, parents, logits.argmax(-1).tolist())
    kept = [0] + path
    session.keep_path(kept)
    return path, bonus, kept, hidden_states
