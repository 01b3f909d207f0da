"""``fold.attention``: FOLD attention of a draft block over a long KV cache."""

from __future__ import annotations

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


FAR_POSITIONS = ("shared", "fixed_distance", "none")
# caches fold reads in another dtype than q's (dequantized on load with k_scale, v_scale), as vLLM stores them
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def attention(q, k, v, *, window, rope, alpha=2.0, cache_seqlens=None, block_table=None, keys_rotated=False,
              queries_rotated=False, softmax_scale=None, return_lse=False, backend="auto", check_ranges=None,
              far_position="shared", sliding_window=None, causal=False, k_scale=None, v_scale=None, far_budget=None,
              far_page=64, far_bounds=None, far_rank="bound"):
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
            ``heads_q`` must be a multiple of ``heads_kv`` (GQA). With ``block_table``: pages
            ``[num_blocks, page_size, heads_kv, head_dim]``.
        window: W >= 0, the number of context entries kept at exact positions.
        rope: a :class:`fold.Rope`; ``rope.rotary_dim <= head_dim``.
        alpha: concentration factor of the far memory, in ``[1, 1e4]``. Default: 2.0.
        cache_seqlens: [batch] integer tensor (or a list of ints) of valid lengths,
            ``n_q <= L <= max_len``. Default: every sequence has ``max_len`` entries. Required with
            ``block_table``.
        block_table: [batch, max_blocks] int32, a paged cache as in flash-attn's
            ``flash_attn_with_kvcache``: entry j of sequence b lives at
            ``k[block_table[b, j // page_size], j % page_size]`` (any page size >= 1; powers of two
            from 16 up are fast), and ``max_len = max_blocks * page_size``. Paging changes which address
            is read and nothing else. Default: ``None``, a contiguous cache.
        keys_rotated: ``False``: ``k`` holds unrotated keys (one cache serves both branches).
            ``True``: ``k`` holds ``R_j k_j``, as engines store them; the far branch un-rotates
            them in the kernel. Both layouts give the same result. Default: ``False``.
        queries_rotated: ``False``: ``q`` holds the block's queries before RoPE. ``True``: ``q`` holds
            ``R_p q`` at each row's true position ``p = n + r`` (with ``rope.attention_factor``), as an
            engine's attention layer receives them; the window reads them as they are and the far
            branch turns them by ``far position - p``. Both give the same result. Default: ``False``.
        softmax_scale: Default: ``head_dim ** -0.5``.
        return_lse: also return ``log(Z_N + Z_F)`` as [batch, n_q, heads_q] float32 (natural log),
            so the result merges with other states through :func:`fold.merge_states`.
        backend: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``),
            ``"torch"`` (any device), ``"auto"``: triton on CUDA, torch otherwise.
        far_position: ``"shared"`` (FOLD, the default): every far entry sits at the one position
            ``n - D``, i.e. at distance ``D + r`` from row ``r``. ``"fixed_distance"``: at distance ``D``
            from every row (ReRoPE as the FOLD paper adapts it; pair it with ``alpha=1``). ``"none"``:
            no far memory, the local branch alone (FOLD's window; a sliding layer's native read).
        sliding_window: ``None`` (default), or ``Ws >= n_q`` for a sliding-window layer read by the
            paper's per-layer rule: its native window (``p - j < Ws``, counting the row itself) is the
            local branch, and every older entry is far memory, still at distance ``D + r``
            (``D = window + n_q``, the full layers' far position).
        causal: row ``r`` does not see the block's entries after its own (``j > p``), as a causal
            sliding layer reads its block. Default: ``False`` (the block is bidirectional).
        k_scale, v_scale: an FP8 cache (``k, v`` in ``torch.float8_e4m3fn`` or ``float8_e5m2``, as
            vLLM stores them) holds ``k / k_scale`` and ``v / v_scale``; it is read dequantized on load.
            Positive floats, default 1.0; any cache dtype takes them.
        far_budget: ``None`` (default: every far entry, FOLD as above), or ``N``: the far branch reads at most
            ``K = N // far_page`` pages per sequence and KV head (shared by the block's rows and the GQA
            group). The pages holding entries that are far for some row but not every row (or that also
            hold entries that are not far) are always read, at most ``ceil((n_q - 1) / far_page) + 1``
            (``K`` below that is a ValueError); the rest go to the pages far for every row with the largest
            bound ``scale * alpha * max over rows and heads of sum_i max(q~_i max_i, q~_i min_i)`` (``q~``
            the far query, ``max``/``min`` the page's key bounds, see :mod:`fold.far_pages`), ties to the
            lower page. Each row counts only its own far entries of those pages, and Z_F sums over what is
            read. A budget covering the far memory reads it all: exactly FOLD. ``far_position="shared"`` only.
        far_page: entries per far page, ``P >= 1`` (page t = entries ``[t P, (t + 1) P)``). With ``block_table``
            and a budget it must equal the cache's page size. Default: 64.
        far_bounds: the page bounds (:mod:`fold.far_pages`, kept by the caller as keys are written):
            ``[batch, ceil(max_len / P), heads_kv, 2, head_dim]`` float32 for a contiguous cache,
            ``[num_blocks, heads_kv, 2, head_dim]`` (by physical block) for a paged one. ``None``: computed
            here from the cache each call (``O(L)``, the convenience path). Bounds looser than exact are
            fine. Ignored without ``far_budget``.
        far_rank: how the pages far for every row are ranked: ``"bound"`` (default, the box bound above) or
            ``"keys"``: by their keys, each row's and head's largest far logit per page as a share over the
            ranked pages (a softmax), averaged over rows and heads (:func:`fold.far_pages.select_pages`); it
            reads the keys of at most ``max(2 K, 16) * 16`` pages a round, whatever the length.
        check_ranges: check the values of ``cache_seqlens`` (and the pages ``block_table`` uses)
            against the cache. Reading them costs a host sync on CUDA, so ``None`` (default) checks on
            the CPU and skips on CUDA; ``True`` always checks, ``False`` never. Skipped while
            ``torch.compile`` traces or a CUDA graph captures; shapes, dtypes and devices are always
            checked.

    Returns:
        ``out`` [batch, n_q, heads_q, head_dim] in ``q.dtype``, or ``(out, lse)``. A NaN in ``q`` or
        in a valid entry of ``k``/``v`` gives NaN in every row that reads it, as SDPA does; entries
        beyond ``cache_seqlens`` are never read, whatever they hold.

    Forward only: there is no backward, so call it under ``torch.no_grad()`` (or on tensors that
    do not require grad); a call that would need a gradient raises ``ValueError``. The read is the
    custom op ``torch.ops.fold.attention``: ``torch.compile(fullgraph=True)`` traces through it and
    CUDA graphs capture it.

    Example::

        >>> rope = fold.Rope.from_theta(500000.0, head_dim=128)
        >>> q = torch.randn(1, 10, 32, 128)
        >>> k = v = torch.randn(1, 32768, 8, 128)
        >>> out = fold.attention(q, k, v, window=2048, rope=rope, alpha=2.0)
        >>> out.shape
        torch.Size([1, 10, 32, 128])
    """
    args = _validate(q, k, v, window, rope, alpha, cache_seqlens, block_table, keys_rotated, softmax_scale,
                     return_lse, backend, check_ranges)
    for name, flag in (("queries_rotated", queries_rotated), ("causal", causal)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if far_position not in FAR_POSITIONS:
        raise ValueError(f"far_position must be one of {FAR_POSITIONS}, got {far_position!r}")
    n_q = q.shape[1]
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__}")
        if sliding_window < n_q:
            raise ValueError(f"sliding_window must be >= n_q={n_q} (the block must fit in the layer's window), "
                             f"got {sliding_window}")
    k_scale, v_scale = (validate_cache_scale(name, x) for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
    span = window + n_q if sliding_window is None else int(sliding_window)
    far_pages = _far_pages(args, rope, window, span, alpha, far_position, keys_rotated, queries_rotated, k_scale,
                           far_budget, far_page, far_bounds, far_rank)
    from fold.ops import attention_op

    out, lse = attention_op(args["q"], args["k"], args["v"], rope.inv_freq_on(args["q"].device),
                            args["cache_seqlens"], args["block_table"], window, float(alpha), args["softmax_scale"],
                            rope.rotary_dim, rope.interleaved, rope.attention_factor, keys_rotated,
                            far_position == "shared", queries_rotated, args["backend"], far_position != "none",
                            -1 if sliding_window is None else int(sliding_window), causal, k_scale, v_scale,
                            far_pages, far_page if far_pages is not None else 0)
    return (out, lse) if return_lse else out


def _far_pages(args, rope, window, span, alpha, far_position, keys_rotated, queries_rotated, k_scale, far_budget,
               far_page, far_bounds, far_rank="bound"):
    """Validate the far-budget arguments and select the pages: ``[batch, heads_kv, K]`` int32, or None
    (no budget, or one that covers every sequence's far memory: the full read, exactly FOLD)."""
    q, k, block_table = args["q"], args["k"], args["block_table"]
    if isinstance(far_page, bool) or not isinstance(far_page, numbers.Integral):
        raise TypeError(f"far_page must be an int, got {type(far_page).__name__}")
    if far_page < 1:
        raise ValueError(f"far_page must be >= 1, got {far_page}")
    from fold.far_pages import RANKS

    if not isinstance(far_rank, str):
        raise TypeError(f"far_rank must be a str, one of {RANKS}, got {type(far_rank).__name__}")
    if far_rank not in RANKS:
        raise ValueError(f"far_rank must be one of {RANKS}, got {far_rank!r}")
    if far_budget is None:
        return None
    if isinstance(far_budget, bool) or not isinstance(far_budget, numbers.Integral):
        raise TypeError(f"far_budget must be an int or None, got {type(far_budget).__name__}")
    if far_position != "shared":
        raise ValueError(f"far_budget needs far_position='shared' (the far keys' bounds hold at one shared "
                         f"position), got far_position={far_position!r}")
    batch, n_q, _, head_dim = q.shape
    heads_kv = k.shape[2]
    far_page = int(far_page)
    if block_table is not None and far_page != k.shape[1]:
        raise ValueError(f"far_page={far_page} must equal the paged cache's page size k.shape[1]={k.shape[1]} "
                         "(the cache's pages are the far pages)")
    slots = int(far_budget) // far_page
    needed = -(-(n_q - 1) // far_page) + 1
    if slots < needed:
        raise ValueError(f"far_budget={far_budget} gives {slots} pages of far_page={far_page}; the pages that "
                         f"straddle the block's far/window edge need {needed} (far_budget >= {needed * far_page})")
    max_len = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[1]
    if far_bounds is not None:
        if not isinstance(far_bounds, torch.Tensor):
            raise TypeError(f"far_bounds must be a float32 tensor or None, got {type(far_bounds).__name__}")
        want = ((k.shape[0], heads_kv, 2, head_dim) if block_table is not None
                else (batch, -(-max_len // far_page), heads_kv, 2, head_dim))
        if tuple(far_bounds.shape) != want:
            raise ValueError(f"far_bounds must have shape {list(want)} (see fold.far_pages), got "
                             f"{tuple(far_bounds.shape)}")
        if far_bounds.dtype != torch.float32:
            raise TypeError(f"far_bounds must be float32, got {far_bounds.dtype}")
        if far_bounds.device != q.device:
            raise ValueError(f"far_bounds must be on q's device {q.device}, got {far_bounds.device}")
    if slots * far_page >= max_len - span:              # every sequence's far memory fits: read it all
        return None
    from fold import far_pages
    from fold.torch_path import serial_on_cpu

    seqlens = args["cache_seqlens"]
    with serial_on_cpu(q.device):                        # many small ops: one thread each on a CPU (as a read)
        if far_bounds is None:
            far_bounds = far_pages.page_bounds(k, far_page, cache_seqlens=seqlens, block_table=block_table,
                                               keys_rotated=keys_rotated, rope=rope, k_scale=k_scale)
        q_far = far_pages.far_queries(q, rope, seqlens, window=window, max_len=max_len,
                                      queries_rotated=queries_rotated)
        return far_pages.select_pages(q_far, far_bounds, seqlens, max_len=max_len, n_q=n_q, span=span,
                                      far_page=far_page, num_slots=slots, scale=args["softmax_scale"] * alpha,
                                      block_table=block_table, rank=far_rank, keys=k, keys_rotated=keys_rotated,
                                      rope=rope, k_scale=k_scale)


def validate_cache_scale(name, x) -> float:
    """An FP8 cache's dequantization scale: None (1.0) or a finite float > 0."""
    if x is None:
        return 1.0
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number or None (a float, not a tensor: it is a launch "
                        f"argument), got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return float(x)


def check_tensor(name, x, shape_doc):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have shape {shape_doc} (4 dims), got {tuple(x.shape)}")


def validate_query_and_cache(q, k, v, *, q_doc, k_name="k", v_name="v", extra=(), block_table=None, fp8_cache=False):
    """Shapes, dtypes and devices of ``q`` and a cache ``k, v``: ``[batch, max_len, heads_kv, head_dim]``,
    or pages ``[num_blocks, page_size, heads_kv, head_dim]`` with ``block_table [batch, max_blocks]``
    (int32). ``extra`` = ``[(name, tensor)]`` more tensors that must share q's dtype and device;
    ``fp8_cache``: ``k, v`` may also both be one of :data:`FP8_DTYPES`.
    Returns ``(batch, n, heads_q, head_dim, max_len, heads_kv)``."""
    paged = block_table is not None
    cache_doc = "[num_blocks, page_size, heads_kv, head_dim]" if paged else "[batch, max_len, heads_kv, head_dim]"
    check_tensor("q", q, q_doc)
    check_tensor(k_name, k, cache_doc)
    check_tensor(v_name, v, cache_doc)
    batch, n, heads_q, head_dim = q.shape
    if min(q.shape) == 0:
        raise ValueError(f"q must have shape {q_doc} with no empty dim, got {tuple(q.shape)}")
    if paged:
        if k.shape[3] != head_dim or min(k.shape) == 0:
            raise ValueError(f"{k_name} must have shape [num_blocks, page_size, heads_kv, head_dim={head_dim}] "
                             f"with no empty dim (a paged cache), got {tuple(k.shape)}")
    elif k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] == 0:
        raise ValueError(f"{k_name} must have shape [batch={batch}, max_len, heads_kv, head_dim={head_dim}], "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name} must have the shape of {k_name} {tuple(k.shape)}, got {tuple(v.shape)}")
    heads_kv = k.shape[2]
    check_forward_only((("q", q), (k_name, k), (v_name, v), *extra))
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} (q.shape[2]) must be a multiple of heads_kv={heads_kv} ({k_name}.shape[2])")
    if q.dtype not in TORCH_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    cache_fp8 = fp8_cache and k.dtype in FP8_DTYPES
    if cache_fp8 and v.dtype != k.dtype:
        raise TypeError(f"{v_name} must have {k_name}'s FP8 dtype {k.dtype}, got {v.dtype}")
    same_dtype = extra if cache_fp8 else ((k_name, k), (v_name, v), *extra)
    for name, x in same_dtype:
        if x.dtype != q.dtype:
            more = f" or, for an FP8 cache, both one of {[str(d) for d in FP8_DTYPES]}" if fp8_cache else ""
            raise TypeError(f"{name} must have q's dtype {q.dtype}{more}, got {x.dtype}")
    for name, x in ((k_name, k), (v_name, v), *extra):
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    if not paged:
        return batch, n, heads_q, head_dim, k.shape[1], heads_kv
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a [batch, max_blocks] int32 tensor or None, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32 (flash-attn's convention), got {block_table.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape [batch={batch}, max_blocks >= 1], got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on q's device {q.device}, got {block_table.device}")
    return batch, n, heads_q, head_dim, block_table.shape[1] * k.shape[1], heads_kv


def check_forward_only(tensors) -> None:
    """fold's ops have no backward: refuse a call that autograd would have to differentiate."""
    if torch.is_grad_enabled():
        needs = [name for name, x in tensors if x.requires_grad]
        if needs:
            raise ValueError(f"fold's attention ops are forward-only (no backward), but {', '.join(needs)} "
                             "require grad; call them under torch.no_grad() or pass detached tensors")


def _validate(q, k, v, window, rope, alpha, cache_seqlens, block_table, keys_rotated, softmax_scale, return_lse,
              backend, check_ranges) -> dict:
    batch, n_q, heads_q, head_dim, max_len, heads_kv = validate_query_and_cache(
        q, k, v, q_doc="[batch, n_q, heads_q, head_dim]", block_table=block_table, fp8_cache=True)
    if max_len < n_q:
        raise ValueError(f"the cache must hold at least n_q={n_q} entries (the block's own), got max_len={max_len}")
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
    cache_seqlens = validate_seqlens(cache_seqlens, block_table, k, batch, max_len, q.device, check_ranges,
                                     minimum=n_q, lower=f"n_q={n_q}",
                                     why=" (each sequence holds the block's own n_q entries)")
    return dict(q=q, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                backend=backend)


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


def _range_checks_wanted(check_ranges, device) -> bool:
    if check_ranges not in (None, True, False):
        raise TypeError(f"check_ranges must be None, True or False, got {check_ranges!r}")
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return False                                    # no host reads while tracing or capturing
    return device.type != "cuda" if check_ranges is None else check_ranges


def validate_seqlens(cache_seqlens, block_table, k, batch, max_len, device, check_ranges, *, minimum, lower, why=""):
    """``cache_seqlens`` (a [batch] int tensor or list, required with ``block_table``) -> int32 tensor or
    None; when range checks are wanted (:func:`_range_checks_wanted`), its values and the pages the
    table uses are checked against the cache."""
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("cache_seqlens is required with block_table (the pages hold no length)")
        _range_checks_wanted(check_ranges, device)
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
    if _range_checks_wanted(check_ranges, device):
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < minimum or hi > max_len:
            within = f" (the {block_table.shape[1]} pages of {k.shape[1]} entries block_table holds)" \
                if block_table is not None else ""
            raise ValueError(f"cache_seqlens must lie in [{lower}, max_len={max_len}]{why}{within}, "
                             f"got values in [{lo}, {hi}]")
        if block_table is not None:
            page = k.shape[1]
            used = torch.arange(block_table.shape[1], device=device)[None, :] * page < cache_seqlens[:, None].long()
            pages = block_table[used]
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k.shape[0]):
                raise ValueError(f"block_table entries of the pages in use must lie in [0, num_blocks={k.shape[0]}), "
                                 f"got values in [{int(pages.min())}, {int(pages.max())}]")
    return cache_seqlens.contiguous()
