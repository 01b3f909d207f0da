"""The two retrieval baselines, stateful per sequence: InfLLM (drafter side) and CMR (target side).

Both follow the FOLD paper's Appendix B.3 (InfLLM: Xiao et al. 2024; CMR: SpecExtend's cross-model
retrieval):

- InfLLM: FOLD's window ``N_p`` at true distances, plus the first ``init`` entries, the ``topk``
  retrieved blocks of ``block`` entries and the older entries not yet in a block, all at the
  largest local distance ``D - 1``, under one softmax. A block's representative is, per query head,
  the mean raw key of its ``repr`` entries that received the most attention while in the window
  (the mean of all its keys if none did). Every round and layer the block queries, rotated to
  ``D - 1`` and averaged over rows, score the blocks by ``sum_h <q_h, rep_bh>``.
- CMR (SpecExtend's cross-model retrieval): chunks of ``chunk`` entries; the first draft reads the
  ``top`` most recent chunks; after the verifications of rounds 0, ``every``, 2 ``every``, ... the
  target's last full-attention layer scores the prefix with the query at ``t - 1`` (softmax weights
  averaged over heads), and the ``top`` chunks of highest mean weight are selected; chunks started
  since are added. Selected entries are renumbered consecutively, the block after them.
"""

from __future__ import annotations

import inspect

import torch

import fold
from fold.rope import rotate, work_dtype
from fold.spec_decode.rollback import key_layer, layer_keys
from fold.spec_decode.target import decoder_layers, layer_types


class InfLLMRead:
    def __init__(self, rope: fold.Rope, *, window: int, block: int = 128, init: int = 128, topk: int = 16,
                 repr_topk: int = 4):
        self.rope, self.window, self.block, self.init, self.topk, self.repr_topk = rope, window, block, init, topk, repr_topk
        self.scores: dict[int, torch.Tensor] = {}      # layer -> [Hq, entries] attention mass while in the window
        self.reps: dict[int, list[torch.Tensor]] = {}  # layer -> representative per formed block, [Hq, d]

    def _representatives(self, layer, k_raw, n_blocks, group):
        reps = self.reps.setdefault(layer, [])
        scores = self.scores[layer]
        for b in range(len(reps), n_blocks):
            lo = self.init + b * self.block
            keys = k_raw[lo:lo + self.block].repeat_interleave(group, dim=1)          # [block, Hq, d]
            s = scores[:, lo:lo + self.block]                                          # [Hq, block]
            if bool((s > 0).any()):
                top = s.topk(min(self.repr_topk, s.shape[1]), dim=1).indices          # [Hq, repr]
                picked = keys.transpose(0, 1).gather(1, top[..., None].expand(-1, -1, keys.shape[-1]))
                reps.append(picked.mean(dim=1))
            else:                                                                      # never in the window
                reps.append(keys.mean(dim=0))
        return torch.stack(reps) if reps else None                                     # [n_blocks, Hq, d]

    def __call__(self, q, k, v, layer):
        _, n_q, heads_q, head_dim = q.shape
        length, heads_kv = k.shape[1], k.shape[2]
        group, n, d_pos = heads_q // heads_kv, length - n_q, self.window + n_q
        work = work_dtype(q.dtype)
        f2 = self.rope.attention_factor ** 2
        scale = head_dim ** -0.5
        k_raw, v_all = k[0].to(work), v[0].to(work)                                    # [L, Hkv, d]
        r = torch.arange(n_q, device=q.device)
        win_lo = n - d_pos + 1                                                         # row r: j >= win_lo + r
        scores = self.scores.setdefault(layer, torch.zeros(heads_q, 0, dtype=work, device=q.device))
        if scores.shape[1] < length:
            self.scores[layer] = scores = torch.cat([scores, scores.new_zeros(heads_q, length - scores.shape[1])], 1)

        # global candidates, masked per row to the entries outside its window: the first `init`
        # entries, formed blocks (of entries every row sees as old), the rest not yet in a block
        old_end = max(0, win_lo + n_q - 1)                                             # old for some row
        n_blocks = max(0, (max(0, win_lo) - self.init) // self.block)
        q_glob = rotate(q[0].transpose(0, 1).to(work), torch.full((n_q,), d_pos - 1, device=q.device), self.rope,
                        factor=f2)                                                     # [Hq, n_q, d]
        chosen = list(range(min(self.init, old_end)))
        if n_blocks:
            reps = self._representatives(layer, k_raw, n_blocks, group)
            picked = range(n_blocks)
            if n_blocks > self.topk:
                block_scores = torch.einsum("hd,bhd->b", q_glob.mean(dim=1), reps)
                picked = sorted(block_scores.topk(self.topk).indices.tolist())
            for b in picked:
                lo = self.init + b * self.block
                chosen.extend(range(lo, lo + self.block))
        chosen.extend(range(self.init + n_blocks * self.block, old_end))               # remainder
        glob = torch.tensor(chosen, dtype=torch.long, device=q.device)
        # window at true distances (relative to n), global at distance D - 1, one softmax
        j_win = torch.arange(max(0, win_lo), length, device=q.device)
        q_win = rotate(q[0].transpose(0, 1).to(work), r, self.rope, factor=f2)
        k_win = rotate(k_raw[j_win].transpose(0, 1), j_win - n, self.rope, factor=1.0)
        s_win = torch.einsum("hrd,hjd->hrj", q_win, k_win.repeat_interleave(group, 0)) * scale
        s_win = s_win.masked_fill(~(j_win[None, :] >= (win_lo + r)[:, None]), float("-inf"))
        s_glob = torch.einsum("hrd,jhd->hrj", q_glob, k_raw[glob].repeat_interleave(group, 1)) * scale
        s_glob = s_glob.masked_fill(~(glob[None, :] < (win_lo + r)[:, None]), float("-inf"))
        p = torch.softmax(torch.cat([s_win, s_glob], dim=-1), dim=-1)                 # [Hq, n_q, W' + G]
        values = torch.cat([v_all[j_win], v_all[glob]]).repeat_interleave(group, 1)   # [W' + G, Hq, d]
        out = torch.einsum("hrj,jhd->rhd", p, values)
        # attention mass of the committed window entries (the block's own rows are not entries yet)
        committed = j_win < n
        scores[:, j_win[committed]] += p[:, :, :len(j_win)].sum(dim=1)[:, committed]
        return out[None].to(q.dtype)


class CMRRead:
    def __init__(self, rope: fold.Rope, *, chunk: int = 32, top: int = 64, every: int = 8, backend: str = "auto"):
        self.rope, self.chunk, self.top, self.every, self.backend = rope, chunk, top, every, backend
        self.selected: set[int] | None = None      # chunk ids
        self.known_chunks = 0                       # chunks that existed at the last selection update
        self.rounds = 0

    def _n_chunks(self, n):
        return -(-n // self.chunk)

    def entries(self, n: int) -> torch.Tensor:
        """Context entries the next draft reads (chronological), for ``n`` committed entries."""
        n_chunks = self._n_chunks(n)
        if self.selected is None:                                          # first draft after prefill
            self.selected = set(range(max(0, n_chunks - self.top), n_chunks))
        else:
            self.selected |= set(range(self.known_chunks, n_chunks))       # chunks started since
        self.known_chunks = n_chunks
        return torch.cat([torch.arange(c * self.chunk, min((c + 1) * self.chunk, n)) for c in sorted(self.selected)])

    def __call__(self, q, k, v, layer):
        n = k.shape[1] - q.shape[1]
        keep = torch.cat([self.entries(n).to(k.device), torch.arange(n, k.shape[1], device=k.device)])
        return fold.attention(q, k[:, keep], v[:, keep], window=len(keep), rope=self.rope, alpha=1.0,
                              backend=self.backend)

    def select(self, weights: torch.Tensor) -> None:
        """Keep the ``top`` chunks with the highest mean weight (``weights [t]`` over the prefix)."""
        t = weights.shape[0]
        n_chunks = self._n_chunks(t)
        padded = weights.new_zeros(n_chunks * self.chunk)
        padded[:t] = weights
        lengths = torch.full((n_chunks,), self.chunk, dtype=weights.dtype, device=weights.device)
        lengths[-1] = t - (n_chunks - 1) * self.chunk
        means = padded.view(n_chunks, self.chunk).sum(dim=1) / lengths
        self.selected = set(means.topk(min(self.top, n_chunks)).indices.tolist())
        self.known_chunks = n_chunks

    def after_verify(self, target, hidden_states, cache, committed: int, last_index: int) -> None:
        """On refresh rounds: score the prefix with the target's query at ``committed - 1``.

        ``hidden_states`` are the verification's; ``last_index`` is that query's row in them.
        """
        refresh = self.rounds % self.every == 0
        self.rounds += 1
        if refresh:
            self.select(target_attention_weights(target, hidden_states, cache, committed, last_index))


@torch.no_grad()
def target_attention_weights(target, hidden_states, cache, committed: int, row: int) -> torch.Tensor:
    """Softmax weights of the query at position ``committed - 1`` over keys ``[0, committed)`` in the
    target's last full-attention layer, averaged over heads -> ``[committed]``.

    The query is the layer's own (its norms, gate split, partial RoPE: :func:`attention_query`); a
    target outside transformers' ``AttentionInterface`` can provide the same scores as
    ``target.fold_attention_weights(hidden_states, cache, committed, row)`` (the demo's toy does).
    """
    if hasattr(target, "fold_attention_weights"):
        return target.fold_attention_weights(hidden_states, cache, committed, row)
    types = getattr(target.config, "layer_types", None) or ["full_attention"] * len(decoder_layers(target))
    index = max(i for i, t in enumerate(types) if t == "full_attention")
    q, scaling = attention_query(target, index, hidden_states[index][:, row:row + 1],
                                 torch.tensor([committed - 1]))                         # [1, Hq, 1, d]
    keys = layer_keys(cache, key_layer(cache, index, types))[:, :, :committed]           # [1, Hkv, t, d]
    keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    weights = torch.softmax((q @ keys.transpose(-1, -2)).float() * scaling, dim=-1)
    return weights[0, :, 0].mean(dim=0)


@torch.no_grad()
def attention_query(target, index: int, hidden_in, positions):
    """The rotated query of attention layer ``index`` for rows whose layer input is ``hidden_in
    [1, T, H]`` at ``positions [T]`` -> ``(q [1, Hq, T, d], scaling)``, exactly as the layer computes
    it (its norms, gate split, partial or proportional RoPE), read through ``AttentionInterface``."""
    layer = decoder_layers(target)[index]
    attn = layer.self_attn
    x = layer.input_layernorm(hidden_in)
    rotary = target.model.rotary_emb
    pos = positions.view(1, -1).to(x.device)
    types = layer_types(target)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        embeddings = rotary(x, pos, layer_type=types[index] if types else "full_attention")
    else:
        embeddings = rotary(x, pos)
    kwargs = dict(hidden_states=x, position_embeddings=embeddings, attention_mask=None)
    if "shared_kv_states" in inspect.signature(type(attn).forward).parameters:   # only the query is read
        empty = x.new_empty(0)                              # a consumer moves them (.to) before the read
        kwargs["shared_kv_states"] = dict.fromkeys(set(types) or {"full_attention"}, (empty, empty))
    captured = []

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured.append((query, scaling))
        return query.transpose(1, 2), None                  # [B, T, Hq, d], the shape the layer expects

    from fold.spec_decode.swap import attention_swapped

    with attention_swapped(target, capture):
        attn(**kwargs)
    query, scaling = captured.pop()
    return query, (scaling if scaling is not None else attn.scaling)
