"""The demo's target: a tiny byte-level causal LM that retrieves across any length.

``FoldToyForCausalLM`` is a transformers model class (``model_type = "fold_toy"``), registered with
``AutoConfig`` / ``AutoModelForCausalLM`` when ``fold.demo`` is imported, so a directory written by
``save_pretrained`` loads with ``AutoModelForCausalLM.from_pretrained`` offline.

Layers (``config.layer_kinds``):

- ``"local"``: causal attention over the last ``sliding_window`` entries with RoPE; works at any
  length but sees nothing older.
- ``"global"``: causal attention over every entry with no positional encoding (NoPE, as
  SmolLM3's ``no_rope_layers``). Its queries and keys are short causal convolutions of the
  layer's input (``conv_taps`` taps), so a key can describe the bytes *before* its entry and a
  query the bytes ending at the current one: content retrieval (an induction head) is one
  matching step. :meth:`GlobalAttention.induction_init` starts the layer as such a head.

The cache is a transformers ``DynamicCache``: layer ``i`` holds that layer's keys/values (local
layers keep every entry and read the last ``sliding_window``), and one extra layer
(``num_hidden_layers``) holds the global layer's normed input, the convolution's state. Cropping
the cache crops that state too, so speculative verification works unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from fold.spec.drafter import MLP, RMSNorm          # the same blocks (they read hidden/intermediate sizes)


class FoldToyConfig(PretrainedConfig):
    model_type = "fold_toy"

    def __init__(self, vocab_size: int = 257, hidden_size: int = 256, intermediate_size: int = 768,
                 num_hidden_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 head_dim: int = 64, layer_kinds: list[str] | None = None, sliding_window: int = 512,
                 conv_taps: int = 8, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                 mask_token_id: int = 256, tie_word_embeddings: bool = False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.layer_kinds = list(layer_kinds or ["local", "local", "global", "local"][:num_hidden_layers])
        if len(self.layer_kinds) != num_hidden_layers or set(self.layer_kinds) - {"local", "global"}:
            raise ValueError(f"layer_kinds must list 'local' or 'global' for each of the {num_hidden_layers} layers, "
                             f"got {self.layer_kinds}")
        self.sliding_window = sliding_window
        self.conv_taps = conv_taps
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _attend(q, k, v, allowed, scale):
    """``q [B, Hq, T, d]``, ``k, v [B, Hkv, S, d]``, ``allowed [T, S]`` bool (``None``: causal, T = S)
    -> ``[B, T, Hq * d]``."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2).flatten(2)


class LocalAttention(nn.Module):
    """Sliding-window causal attention with RoPE (rotate-half, ``rope_theta``)."""

    def __init__(self, cfg: FoldToyConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.heads_q, self.heads_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.window, self.rope_theta = cfg.sliding_window, cfg.rope_theta

    def inv_freq(self, device) -> torch.Tensor:
        # computed per call, not a buffer: from_pretrained builds modules on the meta device and
        # leaves non-persistent buffers that are not in the checkpoint uninitialised
        d = self.head_dim
        return 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)

    def forward(self, x, cache, layer_idx: int):
        b, t, _ = x.shape
        past = cache.get_seq_length(layer_idx) if cache is not None else 0
        q = self.q_proj(x).view(b, t, self.heads_q, self.head_dim).transpose(1, 2)       # [B, Hq, T, d]
        k = self.k_proj(x).view(b, t, self.heads_kv, self.head_dim).transpose(1, 2)      # [B, Hkv, T, d]
        v = self.v_proj(x).view(b, t, self.heads_kv, self.head_dim).transpose(1, 2)
        angle = torch.arange(past, past + t, device=x.device, dtype=torch.float32)[:, None] * self.inv_freq(x.device)
        cos, sin = torch.cat([angle.cos()] * 2, -1).to(x.dtype), torch.cat([angle.sin()] * 2, -1).to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        outs = []
        for lo in range(0, t, self.window):                 # query chunks: each reads <= 2 windows of keys
            hi = min(t, lo + self.window)
            start = max(0, past + lo - self.window + 1)     # older entries are outside every row's window
            i = torch.arange(past + lo, past + hi, device=x.device)[:, None]
            j = torch.arange(start, past + hi, device=x.device)[None, :]
            outs.append(_attend(q[:, :, lo:hi], k[:, :, start:past + hi], v[:, :, start:past + hi],
                                (j <= i) & (j > i - self.window), self.head_dim ** -0.5))
        return self.o_proj(torch.cat(outs, 1))


class GlobalAttention(nn.Module):
    """Causal attention over every entry, no positions; queries/keys from causal convolutions."""

    def __init__(self, cfg: FoldToyConfig):
        super().__init__()
        h, d, taps = cfg.hidden_size, cfg.head_dim, cfg.conv_taps
        self.q_conv = nn.Conv1d(h, cfg.num_attention_heads * d, taps, bias=False)
        self.k_conv = nn.Conv1d(h, cfg.num_key_value_heads * d, taps, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.heads_q, self.heads_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.taps = taps
        self.state_idx = cfg.num_hidden_layers             # the cache layer holding the convolution's input

    @torch.no_grad()
    def induction_init(self, lags: int = 4, generator: torch.Generator | None = None) -> None:
        """Start as an induction head: ``q_t . k_j`` is large when bytes ``t-i`` equal bytes ``j-1-i``.

        Query tap ``i`` and key tap ``i + 1`` (``i < lags``) share one random projection ``P_i`` per
        KV head (GQA: every query head of a group uses its KV head's ``P_i``); other taps start at 0.
        A query then matches keys whose preceding bytes equal the bytes ending at the query, and the
        value at that key is the byte that followed: copy the continuation.
        """
        h = self.q_conv.in_channels
        self.q_conv.weight.zero_()
        self.k_conv.weight.zero_()
        group = self.heads_q // self.heads_kv
        for i in range(lags):
            p = torch.randn(self.heads_kv, self.head_dim, h, generator=generator) / math.sqrt(h)
            self.k_conv.weight[:, :, self.taps - 2 - i] = p.flatten(0, 1)
            self.q_conv.weight[:, :, self.taps - 1 - i] = p.repeat_interleave(group, 0).flatten(0, 1)

    def forward(self, x, cache, layer_idx: int):
        b, t, _ = x.shape
        past = cache.get_seq_length(layer_idx) if cache is not None else 0
        if cache is not None:                               # the conv state: every normed input so far
            seen, _ = cache.update(x[:, None], x[:, None, :, :1], self.state_idx)
            x_in = seen[:, 0, -(t + self.taps - 1):]
        else:
            x_in = x
        pad = self.taps - 1 - (x_in.shape[1] - t)           # zeros before the first entry
        x_in = F.pad(x_in.transpose(1, 2), (pad, 0))        # [B, H, taps - 1 + T]
        q = self.q_conv(x_in).view(b, self.heads_q, self.head_dim, t).transpose(2, 3)      # [B, Hq, T, d]
        k = self.k_conv(x_in).view(b, self.heads_kv, self.head_dim, t).transpose(2, 3)     # [B, Hkv, T, d]
        v = self.v_proj(x).view(b, t, self.heads_kv, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        i = torch.arange(past, past + t, device=x.device)[:, None]
        j = torch.arange(k.shape[2], device=x.device)[None, :]
        return self.o_proj(_attend(q, k, v, None if past == 0 else j <= i, self.head_dim ** -0.5))

    def weights(self, x_in_last, keys):
        """Head-mean softmax weights of one query over ``keys [1, Hkv, S, d]``; ``x_in_last [taps, H]``."""
        q = self.q_conv(x_in_last.T[None]).view(self.heads_q, 1, self.head_dim)               # [Hq, 1, d]
        k = keys[0].repeat_interleave(self.heads_q // self.heads_kv, 0)                        # [Hq, S, d]
        return torch.softmax((q @ k.transpose(1, 2)).float() * self.head_dim ** -0.5, -1)[:, 0].mean(0)


class FoldToyLayer(nn.Module):
    def __init__(self, cfg: FoldToyConfig, kind: str):
        super().__init__()
        self.self_attn = LocalAttention(cfg) if kind == "local" else GlobalAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cache, layer_idx: int):
        h = h + self.self_attn(self.input_layernorm(h), cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class FoldToyModel(nn.Module):
    def __init__(self, cfg: FoldToyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(FoldToyLayer(cfg, kind) for kind in cfg.layer_kinds)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class FoldToyForCausalLM(PreTrainedModel):
    """The demo target. ``forward(input_ids [B, T], past_key_values=None)`` -> logits ``[B, T, vocab]``.

    Every row of a batch has the same length (no padding); positions continue from the cache.

    Example::

        >>> import fold.demo, transformers
        >>> target = transformers.AutoModelForCausalLM.from_pretrained(fold.demo.TARGET_DIR)
        >>> target(torch.tensor([list(b"def f(x):")])).logits.shape
        torch.Size([1, 9, 257])
    """

    config_class = FoldToyConfig
    base_model_prefix = "model"
    _no_split_modules = ["FoldToyLayer"]

    def __init__(self, config: FoldToyConfig):
        super().__init__(config)
        self.model = FoldToyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, cache=None, past_key_values=None, use_cache: bool = False,
                output_hidden_states: bool = False, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got {tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("fold_toy takes unpadded rows of equal length; attention_mask must be all ones")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        h = self.model.embed_tokens(input_ids)
        hidden = [h] if output_hidden_states else None
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cache, i)
            if output_hidden_states:
                hidden.append(h)
        h = self.model.norm(h)
        if output_hidden_states:
            hidden[-1] = h                                   # transformers' convention: the last one normed
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache,
                                      hidden_states=tuple(hidden) if output_hidden_states else None)

    @torch.no_grad()
    def fold_attention_weights(self, hidden_states, cache, committed: int, row: int) -> torch.Tensor:
        """CMR's target-side scores: the global layer's head-mean weights of the query at position
        ``committed - 1`` over entries ``[0, committed)`` -> ``[committed]``."""
        index = self.config.layer_kinds.index("global")
        attn = self.model.layers[index].self_attn
        x_in = cache.layers[attn.state_idx].keys[0, 0, :committed][-attn.taps:]                # [<=taps, H]
        x_in = F.pad(x_in.T, (attn.taps - x_in.shape[0], 0)).T
        return attn.weights(x_in, cache.layers[index].keys[:, :, :committed])


def register() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know ``model_type = "fold_toy"`` (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register("fold_toy", FoldToyConfig)
        AutoModelForCausalLM.register(FoldToyConfig, FoldToyForCausalLM)
    except ValueError:                                     # already registered
        pass
