"""The demo's target: a tiny causal LM that retrieves across any length.

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

A context channel (``channel_lags = L > 0``, ``channel_width = w``): the last ``1 + (L + 1) w``
dimensions of the residual stream are read by every layer and written by none. Each token's
embedding holds, there, a constant 1 and a fixed ``w``-dimensional code of the token; the token
shift copies the codes of the previous ``L`` tokens into ``L`` more slots. So every hidden state
states its token and the ``L`` tokens before it in a form a linear map reads exactly, as the states
of a deep target describe local context, and a drafter reading them can find "the entry preceded
by these tokens" by content. Layers write only the first ``hidden - channel`` dimensions.

The cache is a transformers ``DynamicCache``: layer ``i`` holds that layer's keys/values (local
layers keep every entry and read the last ``sliding_window``), one extra layer
(``num_hidden_layers``) holds the global layer's normed input, the convolution's state, and
another (``num_hidden_layers + 1``) the token codes the shift reads. Cropping the cache crops
those states too, so speculative verification works unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from fold.rope import theta_inv_freq
from fold.spec_decode.drafter import MLP, AttentionProjections, RMSNorm   # the same blocks as the drafters


class FoldToyConfig(PretrainedConfig):
    model_type = "fold_toy"

    def __init__(self, vocab_size: int = 257, hidden_size: int = 256, intermediate_size: int = 768,
                 num_hidden_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 head_dim: int = 64, layer_kinds: list[str] | None = None, sliding_window: int = 512,
                 conv_taps: int = 8, channel_lags: int = 0, channel_width: int = 0, global_log_scale_from: int = 0,
                 rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-6, mask_token_id: int = 256, tie_word_embeddings: bool = False, **kwargs):
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
        self.channel_lags = channel_lags
        self.global_log_scale_from = global_log_scale_from
        self.channel_width = channel_width if channel_lags else 0
        if channel_lags < 0 or (channel_lags and channel_width < 1):
            raise ValueError(f"channel_lags must be >= 0 and channel_width >= 1 with lags, got {channel_lags}, "
                             f"{channel_width}")
        if self.channel_dims >= hidden_size // 2:
            raise ValueError(f"the context channel ({self.channel_dims} dims) must be under half of hidden_size "
                             f"{hidden_size}")
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def channel_dims(self) -> int:
        """Width of the context channel: a constant, the token's code and ``channel_lags`` earlier codes."""
        return 1 + (self.channel_lags + 1) * self.channel_width if self.channel_lags else 0

    @property
    def write_dims(self) -> int:
        """Residual dimensions the layers write (the rest is the context channel)."""
        return self.hidden_size - self.channel_dims


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


class LocalAttention(AttentionProjections):
    """Sliding-window causal attention with RoPE (rotate-half, ``rope_theta``)."""

    def __init__(self, cfg: FoldToyConfig):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         out_dim=cfg.write_dims)
        self.window, self.rope_theta = cfg.sliding_window, cfg.rope_theta

    def inv_freq(self, device) -> torch.Tensor:
        # computed per call, not a buffer: from_pretrained builds modules on the meta device and
        # leaves non-persistent buffers that are not in the checkpoint uninitialised
        return theta_inv_freq(self.rope_theta, self.head_dim).to(device)

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
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.write_dims, bias=False)
        self.heads_q, self.heads_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.taps = taps
        self.log_scale_from = cfg.global_log_scale_from
        self.state_idx = cfg.num_hidden_layers             # the cache layer holding the convolution's input

    @torch.no_grad()
    def induction_init(self, lags: int = 4, generator: torch.Generator | None = None, copy_gain: float = 0.0) -> None:
        """Start as an induction head: ``q_t . k_j`` is large when tokens ``t-i`` equal tokens ``j-1-i``.

        Query tap ``i`` and key tap ``i + 1`` (``i < lags``) share one random projection ``P_i`` per
        KV head (GQA: every query head of a group uses its KV head's ``P_i``); other taps start at 0.
        A query then matches keys whose preceding tokens equal the tokens ending at the query, and the
        value at that key is the token that followed: copy the continuation.

        With ``copy_gain > 0`` the value/output path starts as a copy too: ``o_proj(v_proj(x))`` is
        ``copy_gain`` times the projection of ``x`` on a random ``heads_kv * head_dim``-dimensional
        subspace, so the layer adds (most of) the matched entry's own input to the residual.
        """
        h = self.q_conv.in_channels
        self.q_conv.weight.zero_()
        self.k_conv.weight.zero_()
        group = self.heads_q // self.heads_kv
        for i in range(lags):
            p = torch.randn(self.heads_kv, self.head_dim, h, generator=generator) / math.sqrt(h)
            self.k_conv.weight[:, :, self.taps - 2 - i] = p.flatten(0, 1)
            self.q_conv.weight[:, :, self.taps - 1 - i] = p.repeat_interleave(group, 0).flatten(0, 1)
        if copy_gain > 0:
            rows = self.heads_kv * self.head_dim
            basis, _ = torch.linalg.qr(torch.randn(h, rows, generator=generator))      # [h, rows], orthonormal
            self.v_proj.weight.copy_(basis.T)
            per_head = basis.T.view(self.heads_kv, self.head_dim, h).repeat_interleave(group, 0)   # [Hq, d, h]
            self.o_proj.weight.copy_(copy_gain / group * per_head.flatten(0, 1).T[:self.o_proj.out_features])

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
        q = q * self.length_scale(i[:, 0] + 1).to(q.dtype)[:, None]
        return self.o_proj(_attend(q, k, v, None if past == 0 else j <= i, self.head_dim ** -0.5))

    def length_scale(self, n_keys: torch.Tensor) -> torch.Tensor:
        """``max(1, ln n / ln L)`` for a query reading ``n`` keys (``L = log_scale_from``; 1 when 0): the
        logits sharpen with the log of the length beyond ``L``, so a match keeps its share of the
        softmax among more entries (as Llama 4's NoPE layers scale their queries)."""
        if not self.log_scale_from:
            return torch.ones_like(n_keys, dtype=torch.float32)
        return torch.clamp(torch.log(n_keys.float()) / math.log(self.log_scale_from), min=1.0)

    def weights(self, x_in_last, keys):
        """Head-mean softmax weights of one query over ``keys [1, Hkv, S, d]``; ``x_in_last [taps, H]``."""
        q = self.q_conv(x_in_last.T[None]).view(self.heads_q, 1, self.head_dim)               # [Hq, 1, d]
        q = q * self.length_scale(torch.tensor([keys.shape[2]])).to(q.dtype)
        k = keys[0].repeat_interleave(self.heads_q // self.heads_kv, 0)                        # [Hq, S, d]
        return torch.softmax((q @ k.transpose(1, 2)).float() * self.head_dim ** -0.5, -1)[:, 0].mean(0)


class TokenShift(nn.Module):
    """Copies the codes of the previous ``L`` tokens into the context channel's lag slots."""

    def __init__(self, cfg: FoldToyConfig):
        super().__init__()
        self.lags, self.width = cfg.channel_lags, cfg.channel_width
        self.code = slice(cfg.write_dims + 1, cfg.write_dims + 1 + self.width)      # the token's own code
        self.state_idx = cfg.num_hidden_layers + 1          # the cache layer holding the codes so far

    def forward(self, e, cache):
        t = e.shape[1]
        codes = e[..., self.code]                                              # [B, T, w]
        if cache is not None:
            seen, _ = cache.update(codes[:, None], codes[:, None, :, :1], self.state_idx)
            seen = seen[:, 0]                                                  # [B, past + T, w]
        else:
            seen = codes
        n = seen.shape[1] - t
        padded = F.pad(seen, (0, 0, self.lags, 0))                             # lags zeros before the first entry
        slots = [padded[:, self.lags + n - lag:self.lags + n - lag + t] for lag in range(1, self.lags + 1)]
        out = e.clone()
        out[..., self.code.stop:self.code.stop + self.lags * self.width] = torch.cat(slots, -1)
        return out


class FoldToyLayer(nn.Module):
    def __init__(self, cfg: FoldToyConfig, kind: str):
        super().__init__()
        self.self_attn = LocalAttention(cfg) if kind == "local" else GlobalAttention(cfg)
        self.mlp = MLP(cfg)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.write_dims, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.channel = cfg.channel_dims

    def _write(self, h, out):
        # the layers write the first write_dims dimensions; the context channel passes through
        return h + (F.pad(out, (0, self.channel)) if self.channel else out)

    def forward(self, h, cache, layer_idx: int):
        h = self._write(h, self.self_attn(self.input_layernorm(h), cache, layer_idx))
        return self._write(h, self.mlp(self.post_attention_layernorm(h)))


class FoldToyModel(nn.Module):
    def __init__(self, cfg: FoldToyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.token_shift = TokenShift(cfg) if cfg.channel_lags else None
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

    @torch.no_grad()
    def init_context_channel(self, generator: torch.Generator | None = None) -> None:
        """Put the context channel into the embedding table: a constant 1, a random code per token
        (unit variance) and zero lag slots (the token shift fills them)."""
        cfg = self.config
        if not cfg.channel_dims:
            return
        w, start = cfg.channel_width, cfg.write_dims
        table = self.model.embed_tokens.weight
        table[:, start:] = 0.0
        table[:, start] = 1.0
        table[:, start + 1:start + 1 + w] = torch.randn(table.shape[0], w, generator=generator).to(table.dtype)

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
        if self.model.token_shift is not None:
            h = self.model.token_shift(h, cache)
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
