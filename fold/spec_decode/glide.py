"""LongSpec's GLIDE drafter: one decoder layer that drafts autoregressively.

    h = embed(x)
    h += self_attn(input_layernorm(h))              # causal, over its own last `window` entries (RoPE)
    h += cross_attn(post_self_attention_layernorm(h))   # keys/values: the target's last-layer KV cache
    h += mlp(post_cross_attention_layernorm(h))
    logits = target.lm_head(h)                      # no final norm

q/k/v projections carry biases (also for Llama), o does not; ``head_dim = hidden / heads``. The
target's embedding and LM head are used. Cross-attention is causal by position: a query at
position p sees the target's committed entries j <= p (at decode time, all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import fold
from fold.rope import rotate, work_dtype
from fold.spec_decode.rollback import layer_keys, layer_values
from fold.spec_decode.drafter import MLP, AttentionProjections, RMSNorm
from fold.spec_decode.tree import expand_level

QUERY_CHUNK = 512   # prefill queries per step, so masks stay [chunk, L]


@dataclass
class GlideConfig:
    hidden_size: int
    intermediate_size: int
    heads_q: int
    heads_kv: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    window: int = 512
    rope: fold.Rope | None = field(default=None, repr=False)


class GlideAttention(AttentionProjections):
    def __init__(self, cfg: GlideConfig):
        super().__init__(cfg.hidden_size, cfg.heads_q, cfg.heads_kv, cfg.head_dim, bias=True)


@dataclass
class GlideState:
    k: torch.Tensor          # [Hkv, capacity, d] post-RoPE keys of the drafter's own entries
    v: torch.Tensor
    length: int = 0          # entries; for a chain, entry i is position i
    tree_base: int = 0       # first tree slot while drafting a tree


class GlideDrafter(nn.Module):
    def __init__(self, cfg: GlideConfig):
        super().__init__()
        self.cfg = cfg
        self.self_attn = GlideAttention(cfg)
        self.cross_attn = GlideAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_self_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_cross_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._target: tuple[nn.Module, nn.Module] | None = None

    def bind(self, target) -> None:
        self._target = (target.get_input_embeddings(), target.get_output_embeddings())

    def new_state(self, capacity: int) -> GlideState:
        w = self.self_attn.k_proj.weight
        shape = (self.cfg.heads_kv, capacity, self.cfg.head_dim)
        return GlideState(torch.zeros(shape, dtype=w.dtype, device=w.device), torch.zeros(shape, dtype=w.dtype,
                                                                                          device=w.device))

    def _rope(self, x, positions):
        return rotate(x.to(work_dtype(x.dtype)), positions, self.cfg.rope).to(x.dtype)

    def _heads(self, x, n_heads):
        return x.view(x.shape[0], n_heads, self.cfg.head_dim).transpose(0, 1)           # [H, T, d]

    @staticmethod
    def _attend(q, k, v, visible):
        # q [Hq, T, d], k/v [Hkv, L, d], visible [T, L] -> [T, Hq * d]
        group = q.shape[0] // k.shape[0]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                             attn_mask=visible)
        return out.transpose(0, 1).reshape(q.shape[1], -1)

    @torch.no_grad()
    def forward_tokens(self, state: GlideState, tokens: torch.Tensor, target_cache, positions=None,
                       tree_visible=None) -> torch.Tensor:
        """Append ``tokens [T]`` to the drafter's cache and return their logits ``[T, V]``.

        By default token i sits at position ``state.length + i`` (a chain). For tree nodes pass their
        ``positions [T]`` and ``tree_visible [T, T_tree]``: which of the tree entries appended since
        ``state.tree_base`` (earlier levels and this one) each node sees; every node also sees the
        committed entries before ``state.tree_base`` within the window.
        """
        cfg = self.cfg
        start, n = state.length, tokens.shape[0]
        if start + n > state.k.shape[1]:
            grow = max(start + n, 2 * state.k.shape[1])
            state.k = torch.cat([state.k, state.k.new_zeros(state.k.shape[0], grow - state.k.shape[1], cfg.head_dim)], 1)
            state.v = torch.cat([state.v, state.v.new_zeros(state.v.shape[0], grow - state.v.shape[1], cfg.head_dim)], 1)
        chain = positions is None
        pos = torch.arange(start, start + n, device=tokens.device) if chain else positions
        h = self._target[0](tokens).to(state.k.dtype)                                  # [T, H]
        x = self.input_layernorm(h)
        a = self.self_attn
        q = self._rope(self._heads(a.q_proj(x), cfg.heads_q), pos)
        state.k[:, start:start + n] = self._rope(self._heads(a.k_proj(x), cfg.heads_kv), pos)
        state.v[:, start:start + n] = self._heads(a.v_proj(x), cfg.heads_kv)
        state.length = start + n
        k_target = layer_keys(target_cache, -1)[0].to(h.dtype)                     # [Hkv, Lt, d] post-RoPE
        v_target = layer_values(target_cache, -1)[0].to(h.dtype)
        outs = []
        for c0 in range(0, n, QUERY_CHUNK):                                           # self-attention
            p = pos[c0:c0 + QUERY_CHUNK]
            if chain:                                                                  # slots are positions
                lo, hi = max(0, int(p[0]) - cfg.window), int(p[-1]) + 1
                j = torch.arange(lo, hi, device=tokens.device)
                visible = (j[None, :] <= p[:, None]) & (p[:, None] - j[None, :] <= cfg.window)
            else:                                                                      # committed + tree slots
                lo, hi = 0, state.length
                j = torch.arange(0, state.tree_base, device=tokens.device)
                committed = (p[:, None] - j[None, :] <= cfg.window)
                visible = torch.cat([committed, tree_visible[c0:c0 + QUERY_CHUNK]], dim=1)
            outs.append(self._attend(q[:, c0:c0 + QUERY_CHUNK], state.k[:, lo:hi], state.v[:, lo:hi], visible))
        h = h + a.o_proj(torch.cat(outs))
        c = self.cross_attn
        xc = self.post_self_attention_layernorm(h)
        qc = self._rope(self._heads(c.q_proj(xc), cfg.heads_q), pos)
        jt = torch.arange(k_target.shape[1], device=tokens.device)
        outs = [self._attend(qc[:, c0:c0 + QUERY_CHUNK], k_target, v_target,
                             jt[None, :] <= pos[c0:c0 + QUERY_CHUNK, None]) for c0 in range(0, n, QUERY_CHUNK)]
        h = h + c.o_proj(torch.cat(outs))
        h = h + self.mlp(self.post_cross_attention_layernorm(h))
        return self._target[1](h).float()

    def crop(self, state: GlideState, length: int) -> None:
        state.length = min(state.length, length)


@torch.no_grad()
def glide_tree(drafter: GlideDrafter, state: GlideState, root_logits: torch.Tensor, anchor: int, widths,
               target_cache):
    """LongSpec's beam tree: level 1 = the top ``widths[0]`` tokens at the root; level i keeps the
    global top ``widths[i-1]`` of parent cumulative log-prob + log p(child) over parents x vocab.
    The root (the anchor) is the drafter's last committed entry. Returns ``(tokens, parents, depths,
    node_logits)`` with node 0 the root and ``node_logits[i]`` the draft logits after node i (for the
    nodes that were expanded); the drafter's tree entries are left after ``state.tree_base``."""
    base_pos = state.length - 1                                   # the anchor's position
    state.tree_base = state.length
    tokens, parents, depths, scores = [anchor], [-1], [0], [0.0]
    frontier, logits = [0], root_logits[None]                     # nodes of the last level and their logits
    node_logits = {0: root_logits}
    for level, width in enumerate(widths):
        frontier = expand_level(tokens, parents, depths, scores, list(zip(frontier, logits)), width)
        if level + 1 == len(widths):
            break
        # this level's nodes through the drafter: each sees its tree ancestors among non-root nodes
        n_tree = len(tokens) - 1                                  # non-root nodes so far
        visible = torch.zeros(len(frontier), n_tree, dtype=torch.bool)
        for row, node in enumerate(frontier):
            a = node
            while a > 0:
                visible[row, a - 1] = True
                a = parents[a]
        new_slots = state.length - state.tree_base                # tree entries appended before this level
        visible = visible[:, :new_slots + len(frontier)]
        device = state.k.device
        positions = torch.tensor([base_pos + depths[n] for n in frontier], device=device)
        logits = drafter.forward_tokens(state, torch.tensor([tokens[n] for n in frontier], device=device),
                                        target_cache, positions=positions, tree_visible=visible.to(device))
        node_logits.update(zip(frontier, logits))
    return tokens, parents, depths, node_logits
