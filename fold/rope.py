"""``fold.Rope``: the rotary embedding a drafter was trained with, as the kernels need it."""

from __future__ import annotations

import math

import torch

from fold.checks import check_bool, check_float, check_int


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype fold computes rotations and attention states in: float64 for float64 inputs, float32
    for everything else (float16/bfloat16 inputs are upcast, as PyTorch's own kernels accumulate)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Rope:
    """Rotary position embedding parameters.

    ``R_j x`` rotates the first ``rotary_dim`` dimensions of ``x`` by the angles ``j * inv_freq``
    and multiplies them by ``attention_factor`` (YaRN's mscale, as transformers multiplies cos and
    sin); the remaining ``head_dim - rotary_dim`` dimensions pass through unchanged.

    Args:
        inv_freq: [rotary_dim / 2] inverse frequencies (stored as float32, as transformers does).
        rotary_dim: rotated dimensions, even. Default: ``2 * len(inv_freq)``.
        interleaved: pair ``x[2i]`` with ``x[2i+1]`` (GPT-J). Default ``False``: pair ``x[i]`` with
            ``x[i + rotary_dim/2]`` (NeoX, Llama, Qwen, Gemma).
        attention_factor: multiplies cos and sin. Default 1.0.

    Example::

        >>> rope = fold.Rope.from_theta(500000.0, head_dim=128)
        >>> rope.rotary_dim, rope.inv_freq.shape
        (128, torch.Size([64]))
    """

    def __init__(self, inv_freq: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False,
                 attention_factor: float = 1.0):
        if not isinstance(inv_freq, torch.Tensor):
            raise TypeError(f"inv_freq must be a torch.Tensor of shape [rotary_dim / 2], got {type(inv_freq).__name__}")
        if inv_freq.ndim != 1 or inv_freq.numel() == 0:
            raise ValueError(f"inv_freq must have shape [rotary_dim / 2] with at least one entry, got {tuple(inv_freq.shape)}")
        if not inv_freq.is_floating_point() or not bool(torch.isfinite(inv_freq).all()):
            raise ValueError("inv_freq must hold finite floating-point values")
        rotary_dim = 2 * inv_freq.numel() if rotary_dim is None else check_int("rotary_dim", rotary_dim)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        if rotary_dim != 2 * inv_freq.numel():
            raise ValueError(f"rotary_dim={rotary_dim} needs inv_freq of shape [{rotary_dim // 2}], "
                             f"got {tuple(inv_freq.shape)}")
        check_bool("interleaved", interleaved)
        attention_factor = check_float("attention_factor", attention_factor, 0, open_low=True)
        self.inv_freq = inv_freq.detach().to(device="cpu", dtype=torch.float32).contiguous()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.attention_factor = attention_factor
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}           # (device, dtype) -> cos, sin
        self._ranges: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}           # negative ranges, recent

    @classmethod
    def from_theta(cls, theta: float, head_dim: int, rotary_dim: int | None = None) -> Rope:
        """Standard RoPE: ``inv_freq[i] = theta ** (-2i / rotary_dim)``; ``rotary_dim`` defaults to ``head_dim``."""
        head_dim = check_int("head_dim", head_dim, 1, expected="a positive int")
        rotary_dim = head_dim if rotary_dim is None else check_int("rotary_dim", rotary_dim)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        theta = check_float("theta", theta, 1, open_low=True)
        return cls(theta_inv_freq(theta, rotary_dim), rotary_dim=rotary_dim)

    @classmethod
    def from_config(cls, config) -> Rope:
        """Build from a transformers config, through transformers' own rope initialisation.

        Every ``rope_type`` transformers knows (``default``, ``linear``, ``dynamic`` at its base
        length, ``yarn``, ``longrope``, ``llama3``, ...) gives the same ``inv_freq`` and
        ``attention_factor`` the model uses, and ``partial_rotary_factor`` gives ``rotary_dim``.
        """
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", None))
            if theta is None:
                raise ValueError("config has no rope_theta (neither config.rope_parameters['rope_theta'] "
                                 "nor config.rope_theta)")
            head_dim = getattr(config, "head_dim", None)
            if head_dim is None:
                hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
                if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
                    raise ValueError("config has no head_dim, and no hidden_size and num_attention_heads to derive it")
                head_dim = hidden // heads
            factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
            return cls.from_theta(float(theta), head_dim, rotary_dim=int(head_dim * factor))
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"config's rope_type {rope_type!r} is unknown to transformers; "
                             f"known: {sorted(ROPE_INIT_FUNCTIONS)}")
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return cls(inv_freq, attention_factor=float(attention_factor))

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` as float32 on ``device``, copied once per device."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]

    def cos_sin(self, start: int, count: int, *, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [count, rotary_dim / 2]`` of the positions ``start .. start + count - 1`` (a pure
        rotation, no ``attention_factor``), formed in float64 and stored in ``dtype``.

        Non-negative positions are slices of one table per device and dtype, grown (doubling) to the
        largest position asked for and kept, as engines keep a cos/sin cache: 2 x 4 bytes x
        ``rotary_dim / 2`` per position in float32 (64 MiB at 128K positions for rotary_dim 128),
        shared by every layer and call. Ranges that start below zero (a window's positions relative to
        its block) are computed and the last few kept.
        """
        device = torch.device(device)
        if start < 0:
            key = (device, dtype, start, count)
            if key not in self._ranges:
                if len(self._ranges) >= 16:
                    self._ranges.pop(next(iter(self._ranges)))
                angle = torch.arange(start, start + count, dtype=torch.float64, device=device)[:, None] * \
                    self.inv_freq_on(device).double()
                self._ranges[key] = (torch.cos(angle).to(dtype), torch.sin(angle).to(dtype))
            return self._ranges[key]
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < start + count:
            size = max(4096, 1 << (start + count - 1).bit_length())
            angle = torch.arange(size, dtype=torch.float64, device=device)[:, None] * self.inv_freq_on(device).double()
            table = self._tables[key] = (torch.cos(angle).to(dtype), torch.sin(angle).to(dtype))
        return table[0][start:start + count], table[1][start:start + count]

    def __repr__(self) -> str:
        return (f"Rope(rotary_dim={self.rotary_dim}, interleaved={self.interleaved}, "
                f"attention_factor={self.attention_factor})")


def rerope_scale(lengths: torch.Tensor, n_q: int, training_length: int, dtype=torch.float32) -> torch.Tensor:
    """ReRoPE's query scale ``max(1, log(p + 1) / log(training_length))`` at a block's rows' true positions
    ``p = length - n_q + r`` (``lengths [batch]``: each sequence's entries, the block's included; padding
    rows before position 0 take 1): ``[batch, n_q]`` in ``dtype``, formed in float64."""
    p = lengths.to(torch.float64)[:, None] - n_q + torch.arange(n_q, device=lengths.device, dtype=torch.float64)
    return (torch.log((p + 1).clamp(min=1)) / math.log(training_length)).clamp(min=1.0).to(dtype)


def theta_inv_freq(theta: float, dim: int, count: int | None = None) -> torch.Tensor:
    """Standard RoPE's inverse frequencies ``theta ** (-2i / dim)`` for ``i < count`` (default
    ``dim / 2``), float32 -> ``[count]``; the one place they are formed (Gemma-4's proportional RoPE
    takes fewer than ``dim / 2`` over the full ``head_dim``)."""
    count = dim // 2 if count is None else count
    return 1.0 / theta ** (torch.arange(0, 2 * count, 2, dtype=torch.int64).float() / dim)


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: Rope, *, factor: float | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``R_pos x``: rotate the first ``rope.rotary_dim`` dims of ``x [..., N, head_dim]`` by the angles
    ``positions[N] * inv_freq`` and multiply them by ``factor`` (default ``rope.attention_factor``;
    pass ``1.0`` for a pure rotation); the other dims pass through.

    Angles, cos and sin are formed in float64 (exact at any position, also 256K entries back), then
    applied in ``x``'s dtype (float32 for float16/bfloat16 ``x``, whose result is cast back). The one
    home of RoPE in fold: the torch path, the policies and the demo call it.

    Args:
        x: [..., N, head_dim], any strides.
        positions: [N] integer (or float) positions, negative allowed (``R_-j`` un-rotates).
        rope: the :class:`Rope`.
        factor: multiplies the rotary dims. Default: ``rope.attention_factor``.
        out: optional result tensor of ``x``'s shape in the work dtype (written in place).

    Example::

        >>> rope = fold.Rope.from_theta(10000.0, head_dim=64)
        >>> k = torch.randn(8, 100, 64)                                   # [heads, N, d]
        >>> rotated = fold.rope.rotate(k, torch.arange(100), rope)
        >>> back = fold.rope.rotate(rotated, -torch.arange(100), rope)   # == k up to rounding
    """
    work = work_dtype(x.dtype)
    angle = positions.to(device=x.device, dtype=torch.float64)[:, None] * rope.inv_freq_on(x.device).double()
    f = rope.attention_factor if factor is None else factor
    return rotate_with(x, (torch.cos(angle) * f).to(work), (torch.sin(angle) * f).to(work), rope, out=out)


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Rope, *, inverse: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotate` with its tables given: ``cos, sin`` broadcastable to ``[..., N, rotary_dim / 2]``
    in the work dtype, factor included (e.g. from :meth:`Rope.cos_sin`); ``inverse`` rotates by the
    negated angles (``R_-j`` from the tables of ``j``)."""
    work = cos.dtype
    rotary_dim, half = rope.rotary_dim, rope.rotary_dim // 2
    src = x if x.dtype == work else x.to(work)
    sign = 1.0 if inverse else -1.0
    # the pairs turned together: GPT-J's x[2i] with x[2i + 1], or NeoX's x[i] with x[i + rotary_dim / 2]
    pairs = ((slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)) if rope.interleaved
             else (slice(0, half), slice(half, rotary_dim)))
    a, b = src[..., pairs[0]], src[..., pairs[1]]
    if out is None:             # no buffer to fill: the same products, joined (no allocation a compiler must trace)
        ra, rb = torch.addcmul(a * cos, b, sin, value=sign), torch.addcmul(b * cos, a, sin, value=-sign)
        rot = torch.stack((ra, rb), dim=-1).flatten(-2) if rope.interleaved else torch.cat((ra, rb), dim=-1)
        joined = torch.cat((rot, src[..., rotary_dim:]), dim=-1) if rotary_dim < x.shape[-1] else rot
        return joined if x.dtype == work else joined.to(x.dtype)
    out_a, out_b = out[..., pairs[0]], out[..., pairs[1]]
    torch.mul(a, cos, out=out_a)
    out_a.addcmul_(b, sin, value=sign)                                                     # a cos -+ b sin
    torch.mul(b, cos, out=out_b)
    out_b.addcmul_(a, sin, value=-sign)                                                    # b cos +- a sin
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = src[..., rotary_dim:]
    return out if x.dtype == work else out.to(x.dtype)
