"""Block-parallel drafters (z-lab DFlash, DeepSpec DFlash and DSpark) written in fold.

One module serves every checkpoint family (they share the backbone):

    c      = hidden_norm(fc(concat of tapped target layers))       # one context feature per entry
    h      = embed(block ids)                                      # [anchor, MASK x (B-1)]
    layer: q = q_norm(q_proj(ln(h)));  K, V = [k_norm(k_proj(c)) ; k_norm(k_proj(ln(h)))], [v_proj(c) ; v_proj(ln(h))]
           h += o_proj(read(q, K, V));  h += mlp(post_ln(h))
    logits = lm_head(norm(h))

Two block styles:

- ``qwen3`` (z-lab DFlash, DeepSpec ``Qwen3DSparkModel``; z-lab's Gemma drafters too): as above,
  scale ``head_dim ** -0.5``, SwiGLU. z-lab reads the target's embedding table times
  ``dflash_config.input_embedding_scale`` and its LM head times ``output_multiplier``, then
  ``tanh(x / c) * c`` with ``final_logit_softcapping`` (each the identity when absent).
- ``gemma4`` (DeepSpec ``Gemma4DSparkModel``): own embedding times ``sqrt(hidden)``; per layer
  ``x = ln(h)``, ``q = q_norm(q_proj x)``, ``k = k_norm(k_proj ·)``, ``v = v_norm(v_proj ·)`` (``v_proj =
  k_proj`` with ``attention_k_eq_v``; ``v_norm`` has no weight), scale 1, the target's
  full-attention RoPE (proportional, partial); ``h += post_attention_norm(o_proj(read))``,
  ``h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))`` (GELU-tanh), ``h *= layer_scalar``;
  own LM head, then the softcap.

A layer is full or sliding-window (``layer_windows``: its window ``Ws``, counting the current
token) and bidirectional or causal over the block (``layer_causal``); the policy's read applies
each layer's rule (``fold.spec.policies``).

Each layer keeps its context K/V **before RoPE** in the layout ``fold.attention`` reads: one
``[1, capacity, heads_kv, head_dim]`` buffer whose first ``n`` rows are the committed entries; the
block's rows are written after them for the current round only. A context entry is projected once
when it is committed and never again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch
import torch.nn.functional as F
from torch import nn

import fold
from fold.spec.session import LogitRows


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    sample_from_anchor: bool          # DeepSpec: every slot drafts (slot k predicts start + k + 1)
    markov_rank: int = 0              # DSpark's vanilla Markov head, 0 = none
    has_embeddings: bool = False      # DeepSpec ships embed_tokens / lm_head copies
    rope: fold.Rope | None = field(default=None, repr=False)
    style: str = "qwen3"              # "qwen3" or "gemma4" (the block's norms, MLP and residuals)
    layer_windows: list[int | None] = field(default_factory=list)   # per layer: sliding window, None = full
    layer_causal: list[bool] = field(default_factory=list)          # per layer: causal over the block
    softmax_scale: float | None = None   # None: head_dim ** -0.5 (Gemma-4: 1.0)
    embed_scale: float = 1.0          # multiplies the embedding rows (Gemma: sqrt(hidden))
    logit_multiplier: float = 1.0     # z-lab's output_multiplier
    logit_softcap: float | None = None   # tanh(x / c) * c after the LM head
    k_eq_v: bool = False              # Gemma-4 attention_k_eq_v: values are k_proj's output
    hidden_act: str = "silu"          # MLP activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma)

    def __post_init__(self):
        self.layer_windows = list(self.layer_windows) or [None] * self.num_layers
        self.layer_causal = list(self.layer_causal) or [False] * self.num_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-4's RMSNorm: normalise and scale in float32, then cast; ``with_scale=False`` has no weight."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x):
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        gemma = cfg.style == "gemma4"
        norm = (lambda: GemmaRMSNorm(d, cfg.rms_norm_eps)) if gemma else (lambda: RMSNorm(d, cfg.rms_norm_eps))
        self.q_proj = nn.Linear(h, cfg.heads_q * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.heads_kv * d, bias=cfg.attention_bias)
        self.v_proj = None if cfg.k_eq_v else nn.Linear(h, cfg.heads_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.heads_q * d, h, bias=cfg.attention_bias and gemma)
        self.q_norm = norm()
        self.k_norm = norm()
        self.v_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, with_scale=False) if gemma else None
        self.heads_q, self.heads_kv, self.head_dim = cfg.heads_q, cfg.heads_kv, d

    def kv(self, x):
        """Pre-RoPE keys and values of rows ``x [1, T, H]`` -> ``[1, T, heads_kv, d]`` each."""
        shape = (*x.shape[:-1], self.heads_kv, self.head_dim)
        k = self.k_proj(x).view(shape)
        v = k if self.v_proj is None else self.v_proj(x).view(shape)
        return self.k_norm(k), (v if self.v_norm is None else self.v_norm(v))

    def q(self, x):
        return self.q_norm(self.q_proj(x).view(*x.shape[:-1], self.heads_q, self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = getattr(cfg, "hidden_act", "silu") == "gelu_pytorch_tanh"

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class Layer(nn.Module):
    """A Qwen3-style block: ``h += attn(ln(h)); h += mlp(post_ln(h))``."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def finish(self, h, attn_out):
        """The rest of the block after attention: ``attn_out = o_proj(read)`` -> the layer's output."""
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class GemmaLayer(nn.Module):
    """A Gemma-4 block with sandwich norms and ``layer_scalar`` (DeepSpec's ``Gemma4DSparkModel``)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def finish(self, h, attn_out):
        h = h + self.post_attention_layernorm(attn_out)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class MarkovHead(nn.Module):
    """DSpark's vanilla sequential head: ``logits_k += W2 W1[previous token]``."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, prev_token):
        return self.markov_w2(self.markov_w1(prev_token))


@dataclass
class DraftState:
    """One sequence's drafter context: per-layer pre-RoPE K/V of its committed entries."""

    k: list[torch.Tensor]     # per layer [1, capacity, heads_kv, d]
    v: list[torch.Tensor]
    length: int = 0           # committed context entries


class Drafter(nn.Module):
    """A loaded DFlash/DSpark drafter bound to its target's embedding and LM head."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        gemma = cfg.style == "gemma4"
        norm = GemmaRMSNorm if gemma else RMSNorm
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = norm(h, cfg.rms_norm_eps)
        self.norm = norm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList((GemmaLayer if gemma else Layer)(cfg) for _ in range(cfg.num_layers))
        if cfg.has_embeddings:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
            self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        if cfg.markov_rank:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self._target: tuple[nn.Module, nn.Module] | None = None   # a tuple: not registered as submodules

    # -- the target side ------------------------------------------------------------------------
    def bind(self, target) -> None:
        """Use the target's embedding and LM head (z-lab ships none; DeepSpec's copies are kept)."""
        self._target = (target.get_input_embeddings(), target.get_output_embeddings())

    def embed(self, ids):
        """Embedding rows of ``ids`` times ``embed_scale`` (the scale rounded to the table's dtype, as Gemma does)."""
        table = self.embed_tokens.weight if self.cfg.has_embeddings else self._target[0].weight
        rows = F.embedding(ids, table)
        return rows if self.cfg.embed_scale == 1.0 else rows * torch.tensor(self.cfg.embed_scale, dtype=table.dtype)

    def head(self, x):
        """Logits of final hidden states: the LM head, ``logit_multiplier``, then the softcap."""
        logits = self.lm_head(x) if self.cfg.has_embeddings else self._target[1](x)
        if self.cfg.logit_multiplier != 1.0:
            logits = logits * self.cfg.logit_multiplier
        if self.cfg.logit_softcap is not None:
            logits = torch.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
        return logits

    def features(self, hidden_states) -> torch.Tensor:
        """Tap the target's ``hidden_states`` tuple (output of layer i is entry i + 1) -> [B, T, k*H]."""
        return torch.cat([hidden_states[i + 1] for i in self.cfg.target_layer_ids], dim=-1)

    # -- the context cache ----------------------------------------------------------------------
    def new_state(self, capacity: int, device, dtype) -> DraftState:
        shape = (1, capacity + self.cfg.block_size, self.cfg.heads_kv, self.cfg.head_dim)
        return DraftState(k=[torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers],
                          v=[torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers])

    @torch.no_grad()
    def append_context(self, state: DraftState, target_features: torch.Tensor) -> None:
        """Project ``target_features [1, T, k*H]`` of newly committed entries once, into every layer's cache."""
        c = self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))
        n, t = state.length, c.shape[1]
        if n + t + self.cfg.block_size > state.k[0].shape[1]:
            grow = max(n + t + self.cfg.block_size, 2 * state.k[0].shape[1])
            state.k = [torch.cat([x, x.new_zeros(1, grow - x.shape[1], *x.shape[2:])], 1) for x in state.k]
            state.v = [torch.cat([x, x.new_zeros(1, grow - x.shape[1], *x.shape[2:])], 1) for x in state.v]
        for layer, k_buf, v_buf in zip(self.layers, state.k, state.v):
            k, v = layer.self_attn.kv(c)
            k_buf[:, n:n + t] = k
            v_buf[:, n:n + t] = v
        state.length = n + t

    # -- one draft round ------------------------------------------------------------------------
    @torch.no_grad()
    def block_hidden(self, state: DraftState, anchor: int, read) -> torch.Tensor:
        """Final hidden states ``[n_q, H]`` of the block ``[anchor, MASK x (B-1)]``.

        ``read(q, k, v, layer_index) -> o`` is the context policy: ``q [1, n_q, Hq, d]`` pre-RoPE,
        ``k, v [1, L, Hkv, d]`` pre-RoPE with the block's own rows last (row r at position n + r).
        """
        cfg, n = self.cfg, state.length
        device = state.k[0].device
        ids = torch.full((1, cfg.block_size), cfg.mask_token_id, device=device)
        ids[0, 0] = anchor
        h = self.embed(ids).to(self.fc.weight.dtype)
        # reads use head_dim ** -0.5; another softmax scale is folded into q
        q_factor = None if cfg.softmax_scale is None else cfg.softmax_scale * math.sqrt(cfg.head_dim)
        for i, (layer, k_buf, v_buf) in enumerate(zip(self.layers, state.k, state.v)):
            x = layer.input_layernorm(h)
            k_blk, v_blk = layer.self_attn.kv(x)
            k_buf[:, n:n + cfg.block_size] = k_blk
            v_buf[:, n:n + cfg.block_size] = v_blk
            q = layer.self_attn.q(x)
            if q_factor is not None:
                q = q * q_factor
            k, v = k_buf[:, :n + cfg.block_size], v_buf[:, :n + cfg.block_size]
            if cfg.layer_windows[i] is None:
                o = read(q, k, v, i)
            elif hasattr(read, "sliding"):
                o = read.sliding(q, k, v, i, sliding_window=cfg.layer_windows[i], causal=cfg.layer_causal[i])
            else:
                raise ValueError(f"layer {i} is a sliding-window layer but this read has no .sliding rule; "
                                 "use a read from fold.spec.policies.make_read")
            h = layer.finish(h, layer.self_attn.o_proj(o.reshape(1, cfg.block_size, -1)))
        return self.norm(h)[0]

    @torch.no_grad()
    def slot_hidden(self, state: DraftState, anchor: int, read) -> torch.Tensor:
        """Final hidden states of the drafting slots ``[n_drafts, H]`` (the anchor's row too for DeepSpec)."""
        hidden = self.block_hidden(state, anchor, read)
        return hidden[1:] if not self.cfg.sample_from_anchor else hidden

    @torch.no_grad()
    def slot_logits(self, state: DraftState, anchor: int, read) -> torch.Tensor:
        """Base logits of the drafting slots ``[n_drafts, vocab]`` (before any Markov bias)."""
        return self.head(self.slot_hidden(state, anchor, read)).float()

    def markov_bias(self, prev_token: int) -> torch.Tensor:
        """DSpark's bias on the next slot's logits given the previous token, ``[vocab]``."""
        return self.markov_head.bias(torch.tensor(prev_token, device=self.fc.weight.device)).float()

    @torch.no_grad()
    def draft(self, state: DraftState, anchor: int, read, temperature: float = 0.0, generator=None, *,
              max_drafts: int | None = None, cutoff: float = 0.0):
        """Draft tokens of one round: B-1 (z-lab) or B (DeepSpec), DSpark's Markov-corrected.

        ``max_drafts`` keeps the first slots only; ``cutoff`` ends the chain before the first slot whose
        distribution's top probability (at temperature 1 when greedy, else at ``temperature``) is under
        it. The rule looks at the slot's distribution, never at the token drawn from it, so sampling
        stays exact: a slot the chain stops at is drawn by the target instead.

        Returns ``(tokens, probs)``: at temperature 0 the argmax tokens and ``None``; otherwise tokens
        sampled from ``probs [n_drafts, vocab]``, the distributions actually used (for rejection).
        """
        hidden = self.slot_hidden(state, anchor, read)[:max_drafts]                             # [n, H]
        markov = self.cfg.markov_rank > 0
        # on a CPU the LM head costs in proportion to its rows, so a chain that may stop early
        # (cutoff) computes a slot's logits only when it gets there; elsewhere all rows at once
        lazy = cutoff > 0.0 and hidden.device.type == "cpu"
        if temperature == 0.0 and not markov and not lazy:
            logits = self.head(hidden).float()                                                  # [n, V]
            if cutoff > 0.0:
                low = (torch.softmax(logits, -1).amax(-1) < cutoff).nonzero()
                if len(low):
                    logits = logits[:int(low[0, 0])]
            return logits.argmax(-1).tolist(), None
        logits = LogitRows(hidden, lambda x: self.head(x).float()) if lazy else self.head(hidden).float()
        tokens, probs, prev = [], [], anchor
        for k in range(hidden.shape[0]):
            row = logits[k] + self.markov_bias(prev) if markov else logits[k]
            if temperature == 0.0:
                if cutoff > 0.0 and float(torch.softmax(row, -1).max()) < cutoff:
                    break
                prev = int(row.argmax(-1))
            else:
                dist = torch.softmax(row / temperature, dim=-1)
                if float(dist.max()) < cutoff:
                    break
                probs.append(dist)
                prev = int(torch.multinomial(dist, 1, generator=generator)[0])
            tokens.append(prev)
        return tokens, (torch.stack(probs) if probs else None)
