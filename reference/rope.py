"""Rotary position embedding, written out plainly (the reference the kernels are checked against).

``R_j x`` rotates the first ``rotary_dim`` dimensions of ``x`` by the angles ``j * inv_freq`` and
multiplies them by ``attention_factor``; the remaining dimensions pass through. The pair layout is
NeoX's half split (``x[i]`` with ``x[i + rotary_dim/2]``) unless ``interleaved`` (``x[2i]`` with
``x[2i+1]``), exactly as transformers' ``apply_rotary_pos_emb`` and GPT-J do.
"""

import torch


def rope_pairs(x: torch.Tensor, rotary_dim: int, interleaved: bool):
    """Split ``x [..., head_dim]`` into the two halves of each rotary pair and the pass-through part."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2], rest
    half = rotary_dim // 2
    return rot[..., :half], rot[..., half:], rest


def join_pairs(a: torch.Tensor, b: torch.Tensor, rest: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Inverse of :func:`rope_pairs`."""
    rot = torch.stack((a, b), dim=-1).flatten(-2) if interleaved else torch.cat((a, b), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def apply_rope(x, positions, inv_freq, *, rotary_dim, interleaved=False, attention_factor=1.0, inverse=False):
    """Return ``R_pos x`` (or ``R_pos^-1 x`` with ``inverse``), computed in ``x.dtype``.

    x:         [..., head_dim]
    positions: broadcastable to x.shape[:-1], integer or float
    inv_freq:  [rotary_dim / 2]

    Angles are formed in float64 when ``x`` is float64 and in float32 otherwise (what transformers
    does); cos and sin are then cast to ``x.dtype``, so low-precision inputs see PyTorch's own error.
    """
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = positions.to(angle_dtype)[..., None] * inv_freq.to(angle_dtype)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if inverse:
        sin = -sin
        cos, sin = cos / attention_factor, sin / attention_factor
    else:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    a, b, rest = rope_pairs(x, rotary_dim, interleaved)
    return join_pairs(a * cos - b * sin, b * cos + a * sin, rest, interleaved)
