"""``fold.attention``: FOLD attention of a draft block over a long KV cache."""

from __future__ import annotations

import contextlib
import math
import numbers
import os

import torch

from fold.rope import Rope

BACKENDS = ("auto", "torch", "triton")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = TRITON_DTYPES + (torch.float64,)
# alpha -> infinity is a hard max over the far logits; beyond 1e4 nothing changes at float32
# precision, and alpha * logits would start to overflow.
MAX_ALPHA = 1e4


def attention(q, k, v, *, window, rope, alpha=2.0, cache_seqlens=None, keys_rotated=False, softmax_scale=None,
              return_lse=False, backend="auto"):
    r"""FOLD attention (paper Eqs. 1-4) for a draft block of ``n_q`` rows over a KV cache.

    Sequence ``b`` holds ``L = cache_seqlens[b]`` entries: ``n = L - n_q`` committed context
    entries, then the block's own ``n_q`` entries. Row ``r`` sits at position ``p = n + r``; with
    ``D = window + n_q``, entry ``j`` is in row ``r``'s window iff ``p - j < D`` (always the whole
    block), else in its far memory::

        entries j:  0 ....................... n-D+r | n-D+r+1 ........ n-1 | n ... n+n_q-1
        row r:      far memory, all read at         | window: exact RoPE positions
                    position n - D (distance D + r) |                      | the block

        window  s = (R_p q) . (R_j k_j) * scale               Z_N = sum exp(s)
        far     f = (R_{D+r} q) . (R_0 k_j) * scale           Z_F = (sum exp(alpha * f)) ** (1/alpha)
        out = (Z_N o_N + Z_F o_F) / (Z_N + Z_F)

    ``alpha = 1`` is one softmax over the position-mapped logits; ``n <= window`` (or
    ``window >= L``) is plain RoPE attention, i.e. exactly the original drafter.

    Args:
        q: [batch, n_q, heads_q, head_dim] the block's queries before RoPE.
        k, v: [batch, max_len, heads_kv, head_dim] the cache, the block's own keys/values as the last
            ``n_q`` valid entries. Entries at and beyond ``cache_seqlens[b]`` are never read.
            ``heads_q`` must be a multiple of ``heads_kv`` (GQA).
        window: W >= 0, the number of context entries kept at exact positions.
        rope: a :class:`fold.Rope`; ``rope.rotary_dim <= head_dim``.
        alpha: concentration factor of the far memory, in ``[1, 1e4]``. Default: 2.0.
        cache_seqlens: [batch] integer tensor (or a list of ints) of valid lengths,
            ``n_q <= L <= max_len``. Default: every sequence has ``max_len`` entries. The values are
            checked unless a CUDA graph is being captured.
        keys_rotated: ``False``: ``k`` holds unrotated keys (one cache serves both branches).
            ``True``: ``k`` holds ``R_j k_j``, as engines store them; the far branch un-rotates
            them in the kernel. Both layouts give the same result. Default: ``False``.
        softmax_scale: Default: ``head_dim ** -0.5``.
        return_lse: also return ``log(Z_N + Z_F)`` as [batch, n_q, heads_q] float32 (natural log),
            so the result merges with other states through :func:`fold.merge_states`.
        backend: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``),
            ``"torch"`` (any device), ``"auto"``: triton on CUDA, torch otherwise.

    Returns:
        ``out`` [batch, n_q, heads_q, head_dim] in ``q.dtype``, or ``(out, lse)``. A NaN in ``q`` or
        in a valid entry of ``k``/``v`` gives NaN in every row that reads it, as SDPA does; entries
        beyond ``cache_seqlens`` are never read, whatever they hold.

    Forward only: there is no backward, so call it under ``torch.no_grad()`` (or on tensors that
    do not require grad); a call that would need a gradient raises ``ValueError``.

    Example::

        >>> rope = fold.Rope.from_theta(500000.0, head_dim=128)
        >>> q = torch.randn(1, 10, 32, 128)
        >>> k = v = torch.randn(1, 32768, 8, 128)
        >>> out = fold.attention(q, k, v, window=2048, rope=rope, alpha=2.0)
        >>> out.shape
        torch.Size([1, 10, 32, 128])
    """
    q, k, v, cache_seqlens, softmax_scale, backend = _validate(
        q, k, v, window, rope, alpha, cache_seqlens, keys_rotated, softmax_scale, return_lse, backend)
    args = dict(window=window, alpha=float(alpha), softmax_scale=softmax_scale, rotary_dim=rope.rotary_dim,
                interleaved=rope.interleaved, attention_factor=rope.attention_factor,
                keys_rotated=keys_rotated, return_lse=return_lse)
    if backend == "torch":
        from fold._torch_backend import fold_attention_torch

        out, lse = fold_attention_torch(q, k, v, rope, cache_seqlens, window=window, alpha=float(alpha),
                                        softmax_scale=softmax_scale, keys_rotated=keys_rotated, return_lse=return_lse)
    else:
        from fold.config_lookup import config_for
        from fold.kernels.fold_attention import fold_attention_fwd

        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        inv_freq = rope.inv_freq_on(q.device)
        config = config_for(q, k, keys_rotated)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            out, lse = fold_attention_fwd(q, k, v, inv_freq, cache_seqlens, config=config, **args)
    return (out, lse) if return_lse else out


def _check_tensor(name, x, shape_doc):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have shape {shape_doc} (4 dims), got {tuple(x.shape)}")


def validate_query_and_cache(q, k, v, *, q_doc, k_name="k", v_name="v", extra=()):
    """Shapes, dtypes and devices of ``q`` and a cache ``k, v [batch, max_len, heads_kv, head_dim]``;
    ``extra`` = ``[(name, tensor)]`` more tensors that must share q's dtype and device.
    Returns ``(batch, n, heads_q, head_dim, max_len, heads_kv)``."""
    _check_tensor("q", q, q_doc)
    _check_tensor(k_name, k, "[batch, max_len, heads_kv, head_dim]")
    _check_tensor(v_name, v, "[batch, max_len, heads_kv, head_dim]")
    batch, n, heads_q, head_dim = q.shape
    if min(q.shape) == 0:
        raise ValueError(f"q must have shape {q_doc} with no empty dim, got {tuple(q.shape)}")
    if k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] == 0:
        raise ValueError(f"{k_name} must have shape [batch={batch}, max_len, heads_kv, head_dim={head_dim}], "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name} must have the shape of {k_name} {tuple(k.shape)}, got {tuple(v.shape)}")
    max_len, heads_kv = k.shape[1], k.shape[2]
    check_forward_only((("q", q), (k_name, k), (v_name, v), *extra))
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} (q.shape[2]) must be a multiple of heads_kv={heads_kv} ({k_name}.shape[2])")
    if q.dtype not in TORCH_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, x in ((k_name, k), (v_name, v), *extra):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    return batch, n, heads_q, head_dim, max_len, heads_kv


def check_forward_only(tensors) -> None:
    """fold's ops have no backward: refuse a call that autograd would have to differentiate."""
    if torch.is_grad_enabled():
        needs = [name for name, x in tensors if x.requires_grad]
        if needs:
            raise ValueError(f"fold's attention ops are forward-only (no backward), but {', '.join(needs)} "
                             "require grad; call them under torch.no_grad() or pass detached tensors")


def _validate(q, k, v, window, rope, alpha, cache_seqlens, keys_rotated, softmax_scale, return_lse, backend):
    batch, n_q, heads_q, head_dim, max_len, heads_kv = validate_query_and_cache(
        q, k, v, q_doc="[batch, n_q, heads_q, head_dim]")
    if max_len < n_q:
        raise ValueError(f"k must hold at least n_q={n_q} entries (the block's own), got max_len={max_len}")
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int, got {type(window).__name__}")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if not isinstance(rope, Rope):
        raise TypeError(f"rope must be a fold.Rope, got {type(rope).__name__}")
    if rope.rotary_dim > head_dim:
        raise ValueError(f"rope.rotary_dim={rope.rotary_dim} must be <= head_dim={head_dim}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    if not (math.isfinite(alpha) and 1 <= alpha <= MAX_ALPHA):
        raise ValueError(f"alpha must be finite and in [1, {MAX_ALPHA:g}], got {alpha}")
    softmax_scale = validate_scale(softmax_scale, head_dim)
    for name, flag in (("keys_rotated", keys_rotated), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    backend = resolve_backend(backend, q)
    cache_seqlens = _validate_seqlens(cache_seqlens, batch, max_len, q.device, minimum=n_q,
                                      lower=f"n_q={n_q}", why=" (each sequence holds the block's own n_q entries)")
    return q, k, v, cache_seqlens, softmax_scale, backend


def validate_scale(softmax_scale, head_dim) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return float(softmax_scale)


def resolve_backend(backend, q) -> str:
    """``"auto"`` -> triton on CUDA, torch otherwise; checks that the choice can run ``q``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "triton":
        if q.dtype not in TRITON_DTYPES:
            raise TypeError(f"backend='triton' takes float16, bfloat16 or float32, got {q.dtype}; use backend='torch'")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (q is on {q.device}), or TRITON_INTERPRET=1 "
                             "set before fold's kernels are imported; use backend='torch' on this device")
    return backend


def _validate_seqlens(cache_seqlens, batch, max_len, device, *, minimum, lower, why=""):
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, (list, tuple)):
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cache_seqlens):
            raise TypeError("cache_seqlens must hold ints")
        cache_seqlens = torch.tensor(cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a [batch] integer tensor or None, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape [batch={batch}], got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on q's device {device}, got {cache_seqlens.device}")
    capturing = cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < minimum or hi > max_len:
            raise ValueError(f"cache_seqlens must lie in [{lower}, max_len={max_len}]{why}, got values in [{lo}, {hi}]")
    return cache_seqlens.contiguous()
