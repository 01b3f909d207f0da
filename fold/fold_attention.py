"""``fold.attention``: FOLD attention of a draft block over a long KV cache."""

from __future__ import annotations

import os

import torch

from fold.checks import check_bool, check_choice, check_float, check_int, is_int
from fold.far_pages import KeyCache
from fold.read_options import BACKENDS, MAX_ALPHA, ReadOptions  # noqa: F401 (MAX_ALPHA: alpha's documented limit)
from fold.rope import Rope

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = TRITON_DTYPES + (torch.float64,)
# caches fold reads in another dtype than q's (dequantized on load with k_scale, v_scale), as vLLM stores them
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def attention(q, k, v, *, window, rope, alpha=2.0, cache_seqlens=None, block_table=None, keys_rotated=False,
              queries_rotated=False, softmax_scale=None, return_lse=False, backend="auto", check_ranges=None,
              far_position="shared", sliding_window=None, causal=False, k_scale=None, v_scale=None, far_budget=None,
              far_page=64, far_bounds=None, far_rank="bound", softcap=None):
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
        softcap: ``None`` (default) or ``c > 0``: logit soft-capping as Gemma-style drafters train with it,
            each logit ``x = q.k * scale`` of either branch becomes ``c * tanh(x / c)``. In the far branch the
            cap comes first and ``alpha`` multiplies the capped logit (``Z_F = (sum exp(alpha * c tanh(f / c)))
            ** (1/alpha)``): the cap is part of the drafter's own logit, at whatever position FOLD reads the
            key, and alpha sharpens the distribution the drafter's logits give. A budget's page choice ranks
            by the uncapped logits (the cap is monotone: the box bound ranks the same).
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
    options = ReadOptions(alpha=alpha, far_position=far_position, backend=backend, far_budget=far_budget,
                          far_page=far_page, far_rank=far_rank)
    op = _validate(q, k, v, window=window, rope=rope, cache_seqlens=cache_seqlens, block_table=block_table,
                   softmax_scale=softmax_scale, backend=options.backend, check_ranges=check_ranges,
                   sliding_window=sliding_window)
    flags = dict(keys_rotated=keys_rotated, queries_rotated=queries_rotated, causal=causal)
    for name, flag in (*flags.items(), ("return_lse", return_lse)):
        check_bool(name, flag)
    op.update(flags, alpha=options.alpha, far_per_row=options.far_position == "shared",
              read_far=options.far_position != "none", k_scale=validate_cache_scale("k_scale", k_scale),
              v_scale=validate_cache_scale("v_scale", v_scale),
              softcap=check_float("softcap", softcap, 0, open_low=True, none_ok=True) or 0.0)
    op["far_pages"] = _far_pages(op, rope, options, far_bounds)
    op["far_page"] = options.far_page if op["far_pages"] is not None else 0
    from fold.ops import attention_op

    out, lse = attention_op(**op)
    return (out, lse) if return_lse else out


def _far_pages(op: dict, rope: Rope, options: ReadOptions, far_bounds):
    """The far pages a budgeted read reads (:func:`fold.far_pages.select_pages`), ``[batch, heads_kv, K]``
    int32, or None (no budget, or one that covers every sequence's far memory: the full read, exactly FOLD).
    ``op``: the checked arguments of ``fold::attention`` but these."""
    if options.far_budget is None:
        return None
    q, k, far_page = op["q"], op["k"], options.far_page
    cache = KeyCache(k, cache_seqlens=op["cache_seqlens"], block_table=op["block_table"],
                     keys_rotated=op["keys_rotated"], rope=rope, k_scale=op["k_scale"])
    if cache.block_table is not None and far_page != k.shape[1]:
        raise ValueError(f"far_page={far_page} must equal the paged cache's page size k.shape[1]={k.shape[1]} "
                         "(the cache's pages are the far pages)")
    options.check_block(q.shape[1])
    _check_far_bounds(far_bounds, cache, far_page, q)
    span = op["window"] + q.shape[1] if op["sliding_window"] < 0 else op["sliding_window"]
    slots = options.far_budget // far_page
    if slots * far_page >= cache.max_len - span:        # every sequence's far memory fits: read it all
        return None
    from fold import far_pages
    from fold.torch_path import serial_on_cpu

    with serial_on_cpu(q.device):                        # many small ops: one thread each on a CPU (as a read)
        if far_bounds is None:
            far_bounds = far_pages.page_bounds(k, far_page, cache_seqlens=cache.cache_seqlens,
                                               block_table=cache.block_table, keys_rotated=cache.keys_rotated,
                                               rope=rope, k_scale=cache.k_scale)
        q_far = far_pages.far_queries(q, rope, cache.cache_seqlens, window=op["window"], max_len=cache.max_len,
                                      queries_rotated=op["queries_rotated"])
        return far_pages.select_pages(q_far, far_bounds, cache, span=span, far_page=far_page, num_slots=slots,
                                      scale=op["softmax_scale"] * options.alpha, rank=options.far_rank)


def _check_far_bounds(far_bounds, cache: KeyCache, far_page: int, q) -> None:
    """``far_bounds``: None, or the page bounds of ``cache`` (see :mod:`fold.far_pages`) on q's device."""
    if far_bounds is None:
        return
    if not isinstance(far_bounds, torch.Tensor):
        raise TypeError(f"far_bounds must be a float32 tensor or None, got {type(far_bounds).__name__}")
    k = cache.k
    want = ((k.shape[0], k.shape[2], 2, k.shape[3]) if cache.block_table is not None
            else (q.shape[0], -(-cache.max_len // far_page), k.shape[2], 2, k.shape[3]))
    if tuple(far_bounds.shape) != want:
        raise ValueError(f"far_bounds must have shape {list(want)} (see fold.far_pages), got {tuple(far_bounds.shape)}")
    if far_bounds.dtype != torch.float32:
        raise TypeError(f"far_bounds must be float32, got {far_bounds.dtype}")
    if far_bounds.device != q.device:
        raise ValueError(f"far_bounds must be on q's device {q.device}, got {far_bounds.device}")


def validate_cache_scale(name, x) -> float:
    """An FP8 cache's dequantization scale: None (1.0) or a finite float > 0."""
    if isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a real number or None (a float, not a tensor: it is a launch argument), "
                        "got Tensor")
    x = check_float(name, x, 0, open_low=True, none_ok=True)
    return 1.0 if x is None else x


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


def _validate(q, k, v, *, window, rope, cache_seqlens, block_table, softmax_scale, backend, check_ranges,
              sliding_window) -> dict:
    """The tensors and scalars of a call, checked -> the arguments of ``fold::attention`` they give, by name."""
    batch, n_q, heads_q, head_dim, max_len, heads_kv = validate_query_and_cache(
        q, k, v, q_doc="[batch, n_q, heads_q, head_dim]", block_table=block_table, fp8_cache=True)
    if max_len < n_q:
        raise ValueError(f"the cache must hold at least n_q={n_q} entries (the block's own), got max_len={max_len}")
    window = check_int("window", window, 0)
    if not isinstance(rope, Rope):
        raise TypeError(f"rope must be a fold.Rope, got {type(rope).__name__}")
    if rope.rotary_dim > head_dim:
        raise ValueError(f"rope.rotary_dim={rope.rotary_dim} must be <= head_dim={head_dim}")
    sliding_window = check_int("sliding_window", sliding_window, none_ok=True)
    if sliding_window is not None and sliding_window < n_q:
        raise ValueError(f"sliding_window must be >= n_q={n_q} (the block must fit in the layer's window), "
                         f"got {sliding_window}")
    softmax_scale = validate_scale(softmax_scale, head_dim)
    backend = resolve_backend(backend, q)
    cache_seqlens = validate_seqlens(cache_seqlens, block_table, k, batch, max_len, q.device, check_ranges,
                                     minimum=n_q, lower=f"n_q={n_q}",
                                     why=" (each sequence holds the block's own n_q entries)")
    return dict(q=q, k=k, v=v, inv_freq=rope.inv_freq_on(q.device), cache_seqlens=cache_seqlens,
                block_table=block_table, window=window, softmax_scale=softmax_scale, rotary_dim=rope.rotary_dim,
                interleaved=rope.interleaved, attention_factor=rope.attention_factor, backend=backend,
                sliding_window=-1 if sliding_window is None else sliding_window)


def validate_scale(softmax_scale, head_dim) -> float:
    """``softmax_scale``: None (``head_dim ** -0.5``) or a finite float > 0."""
    softmax_scale = check_float("softmax_scale", softmax_scale, 0, open_low=True, none_ok=True)
    return head_dim ** -0.5 if softmax_scale is None else softmax_scale


def resolve_backend(backend, q) -> str:
    """``"auto"`` -> triton on CUDA, torch otherwise; checks that the choice can run ``q``."""
    if check_choice("backend", backend, BACKENDS) == "auto":
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
        if not all(is_int(x) for x in cache_seqlens):
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
