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
each layer's rule (``fold.spec_decode.policies``).

DFlash 2 (z-lab's ``DFlash2DraftModel``) is the ``qwen3`` block with two grouped dynamic causal
convolutions per layer, over the block's rows only (:class:`DynamicConv`; row ``t`` mixes rows
``t, t - 1, ..., t - K + 1`` of its own block, with a base kernel plus per-row coefficients from a
linear ``kernel_projection`` of the layer's normed input)::

    x = ln(h);  x, c = attention_conv.prepare(x);  h += attention_conv.finish(o_proj(read(q(x), K, V)), c)
    x = post_ln(h);  x, c = mlp_conv.prepare(x);   h += mlp_conv.finish(mlp(x), c)

The context K/V are untouched, so every policy's read applies unchanged. Its candidate selector
(:class:`CandidateSelector`) rescores each slot's ``top_k`` logits left to right given the token
before it, ``unary + <predecessor_codebook[prev] * W h, successor_codebook[candidate]>``: greedy
takes the best candidate, sampling draws from the softmax over the ``top_k`` candidates (the ``q``
of rejection sampling).

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
from fold.rope import work_dtype
from fold.spec_decode.session import LogitRows
from fold.spec_decode.tree import expand_level


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
    conv_kernel_size: int = 0         # DFlash 2: taps of each layer's two dynamic convolutions, 0 = none
    conv_group_size: int = 1          # DFlash 2: channels sharing one dynamic coefficient
    selector_rank: int = 0            # DFlash 2: the candidate selector's rank
    selector_top_k: int = 0           # DFlash 2: candidates per slot, 0 = no selector (argmax / softmax)

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


class AttentionProjections(nn.Module):
    """The q/k/v/o projections of an attention layer, named as transformers' checkpoints name them
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``: state dicts load by those names): ``hidden`` ->
    ``heads_q`` queries and ``heads_kv`` keys and values of ``head_dim``, and back to ``out_dim`` (default
    ``hidden``). ``bias`` on q, k, v; ``o_bias`` on o; ``shared_kv``: no ``v_proj`` (the values are k's)."""

    def __init__(self, hidden: int, heads_q: int, heads_kv: int, head_dim: int, *, bias: bool = False,
                 o_bias: bool = False, shared_kv: bool = False, out_dim: int | None = None):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads_q * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, heads_kv * head_dim, bias=bias)
        self.v_proj = None if shared_kv else nn.Linear(hidden, heads_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads_q * head_dim, hidden if out_dim is None else out_dim, bias=o_bias)
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, head_dim


class Attention(AttentionProjections):
    def __init__(self, cfg: DrafterConfig):
        d, gemma = cfg.head_dim, cfg.style == "gemma4"
        super().__init__(cfg.hidden_size, cfg.heads_q, cfg.heads_kv, d, bias=cfg.attention_bias,
                         o_bias=cfg.attention_bias and gemma, shared_kv=cfg.k_eq_v)
        norm = (lambda: GemmaRMSNorm(d, cfg.rms_norm_eps)) if gemma else (lambda: RMSNorm(d, cfg.rms_norm_eps))
        self.q_norm = norm()
        self.k_norm = norm()
        self.v_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, with_scale=False) if gemma else None

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

    def attn_input(self, h):
        """The block rows' input to q/k/v, ``h [1, B, H] -> (x [1, B, H], what finish needs or None)``."""
        return self.input_layernorm(h), None

    def finish(self, h, attn_out, carry=None):
        """The rest of the block after attention: ``attn_out = o_proj(read)`` -> the layer's output."""
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


def dynamic_causal_conv(x, coefficients, base, group_size: int):
    """One grouped dynamic causal convolution over the rows of a block.

    ``x [N, T, H]``, ``coefficients [N, T, K, H // group_size]`` (row t's own), ``base [K, H]``:
    ``y[t, c] = sum_{o < K} (base[o, c] + coefficients[t, o, c // group_size]) * x[t - o, c]``, rows
    before the block's first counting as zero (so taps ``o >= T`` read nothing) -> ``y [N, T, H]``.
    """
    weight = base.to(x.dtype) + coefficients.repeat_interleave(group_size, dim=-1)      # [N, T, K, H]
    y = weight[:, :, 0] * x
    for o in range(1, min(base.shape[0], x.shape[1])):
        y = y + weight[:, :, o] * F.pad(x[:, :-o], (0, 0, o, 0))                        # row t reads x[t - o]
    return y


class DynamicConv(nn.Module):
    """DFlash 2's pair of convolutions around one sub-block (attention or MLP): ``prepare`` convolves
    the sub-block's normed input and returns the coefficients ``finish`` applies to its output; both
    sets of coefficients come from ``kernel_projection`` of that input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x):
        """``x [N, T, H]`` -> ``(conv_0(x) [N, T, H], finish's coefficients [N, T, K, G])``."""
        c = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        return dynamic_causal_conv(x, c[..., 0, :, :], self.base_kernel[0], self.group_size), c[..., 1, :, :]

    def finish(self, y, coefficients):
        return dynamic_causal_conv(y, coefficients, self.base_kernel[1], self.group_size)


class ConvLayer(Layer):
    """A DFlash 2 block: the Qwen3 block with :class:`DynamicConv` around its attention and its MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def attn_input(self, h):
        return self.attention_conv.prepare(self.input_layernorm(h))

    def finish(self, h, attn_out, carry=None):
        h = h + self.attention_conv.finish(attn_out, carry)
        x, coefficients = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), coefficients)


class CandidateSelector(nn.Module):
    """DFlash 2's left-to-right rescoring of each slot's ``top_k`` candidates given the previous token."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))    # bare tensors, as published
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def rescore(self, unary, candidates, projected, prev: int):
        """Scores ``[k]`` of a slot's ``candidates [k]`` (logits ``unary [k]``, ``projected = W h [rank]``,
        both in the work dtype) after token ``prev``: ``unary + <pred[prev] * W h, succ[candidate]>``."""
        work = unary.dtype
        pred = self.predecessor_codebook[prev].to(work) * projected
        return unary + self.successor_codebook[candidates].to(work) @ pred


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

    def attn_input(self, h):
        return self.input_layernorm(h), None

    def finish(self, h, attn_out, carry=None):
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
        block = GemmaLayer if gemma else ConvLayer if cfg.conv_kernel_size else Layer
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.num_layers))
        self.candidate_selector = CandidateSelector(cfg.vocab_size, h, cfg.selector_rank, cfg.selector_top_k) \
            if cfg.selector_top_k else None
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
            x, carry = layer.attn_input(h)
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
                                 "use a read from fold.spec_decode.policies.make_read")
            h = layer.finish(h, layer.self_attn.o_proj(o.reshape(1, cfg.block_size, -1)), carry)
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
        A DFlash 2 drafter walks its candidate selector instead (:meth:`select`).
        """
        hidden = self.slot_hidden(state, anchor, read)[:max_drafts]                             # [n, H]
        if self.candidate_selector is not None:
            return self.select(hidden, anchor, temperature, generator, cutoff)
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

    def _candidates(self, hidden):
        """DFlash 2: ``hidden [n, H]`` -> ``(rows [k, H] -> logits [k, V], W h [n, rank])``, both in the work
        dtype (float64 stays float64, else float32)."""
        work = work_dtype(hidden.dtype)
        return (lambda x: self.head(x).to(work)), self.candidate_selector.hidden_projection(hidden).to(work)

    @torch.no_grad()
    def select(self, hidden, anchor: int, temperature: float = 0.0, generator=None, cutoff: float = 0.0):
        """DFlash 2's drafts of the slots ``hidden [n, H]``, left to right from ``anchor``: each slot's
        ``top_k`` logits rescored given the token before it (:meth:`CandidateSelector.rescore`).

        Greedy takes the best candidate; at ``temperature`` > 0 a candidate is drawn from
        ``softmax(scores / temperature)`` over the ``top_k``, and ``probs [n, vocab]`` holds that
        distribution (zero off the candidates), the ``q`` rejection sampling needs. ``cutoff`` ends the
        chain before a slot whose candidate distribution (at temperature 1 when greedy) tops under it.
        Returns ``(tokens, probs or None)`` as :meth:`draft`.
        """
        selector = self.candidate_selector
        head, projected = self._candidates(hidden)
        lazy = cutoff > 0.0 and hidden.device.type == "cpu"         # a chain that may stop early pays per row
        logits = LogitRows(hidden, head) if lazy else head(hidden)
        tokens, probs, prev = [], [], anchor
        for k in range(hidden.shape[0]):
            unary, candidates = torch.topk(logits[k], selector.top_k)
            scores = selector.rescore(unary, candidates, projected[k], prev)
            dist = torch.softmax(scores / (temperature or 1.0), dim=-1)
            if float(dist.max()) < cutoff:
                break
            if temperature == 0.0:
                index = int(scores.argmax())
            else:
                index = int(torch.multinomial(dist, 1, generator=generator)[0])
                probs.append(torch.zeros(self.cfg.vocab_size, device=dist.device).scatter(0, candidates, dist.float()))
            prev = int(candidates[index])
            tokens.append(prev)
        return tokens, (torch.stack(probs) if probs else None)

    @torch.no_grad()
    def selector_tree(self, state: DraftState, anchor: int, read, widths):
        """DFlash 2's token tree (greedy verification): a node's children at depth ``l + 1`` are slot
        ``l``'s ``top_k`` candidates rescored given the node's own token, and level ``l`` keeps the
        ``widths[l]`` best paths by cumulative log-probability under the selector's softmax
        (``fold.spec_decode.tree.expand_level``'s rule; at most ``top_k`` children per node).
        Returns ``(tokens, parents, depths)`` in level order, node 0 being the anchor."""
        hidden = self.slot_hidden(state, anchor, read)
        selector = self.candidate_selector
        head, projected = self._candidates(hidden)
        logits = head(hidden)
        tokens, parents, depths, scores = [anchor], [-1], [0], [0.0]
        frontier = [0]
        for level, width in enumerate(widths[:hidden.shape[0]]):
            unary, candidates = torch.topk(logits[level], selector.top_k)
            rows = []
            for node in frontier:                                   # -inf off the candidates: never a child
                row = logits.new_full((self.cfg.vocab_size,), float("-inf"))
                rows.append((node, row.scatter(0, candidates,
                                               selector.rescore(unary, candidates, projected[level], tokens[node]))))
            frontier = expand_level(tokens, parents, depths, scores, rows, min(width, selector.top_k * len(frontier)))
        return tokens, parents, depths
