"""How the drafter reads its context: one read per policy and sequence.

A read serves every drafter layer. For a full-attention layer it is called as ``read(q, k, v,
layer)``; for a sliding-window layer as ``read.sliding(q, k, v, layer, sliding_window=Ws,
causal=c)``. Both get the block's pre-RoPE queries ``q [1, n_q, Hq, d]`` and the layer's pre-RoPE
cache ``k, v [1, L, Hkv, d]`` whose last ``n_q`` rows are the block (row r at true position
``n + r``), and return ``o [1, n_q, Hq, d]``; logits use ``head_dim ** -0.5`` (a drafter with
another scale folds the ratio into ``q``). Settings follow the FOLD paper's Appendix B.3:

- ``dflash``: the original drafter, every entry at its true position (context keys rotated once and kept,
  as an engine caches them: :class:`CachedPlainRead`).
- ``window``: FOLD's window ``N_p`` alone (row r sees ``j > n + r - D``), one softmax.
- ``fold``: ``fold.attention`` (window ``W``, far memory at the shared position, ``alpha``); while a
  sequence fits in the window it runs the plain read (length dispatch).
- ``streaming``: StreamingLLM, the first 4 entries and the 2,044 most recent, renumbered
  consecutively, the block after them.
- ``yarn``: every entry at its true position under YaRN frequencies with the per-request factor
  ``s = max(1, ceil((P + G + Q) / 256) * 256 / R)`` on top of the drafter's own ``inv_freq``.
- ``rerope``: FOLD's window at true distances, every older entry at distance ``D`` from every row,
  one softmax, queries scaled by ``max(1, log(p + 1) / log(4096))``.
- ``infllm``, ``cmr``: the retrieval baselines (``fold.spec_decode.retrieval``), stateful per sequence.

Sliding-window layers (window ``Ws`` counting the current token; causal unless the checkpoint says
otherwise) follow Appendix B.3's per-layer rules. Their native read (:func:`sliding_state`): row r
at ``p = n + r`` sees the entries ``p - Ws < j``, and ``j <= p`` when causal (else ``j - p < Ws``).

- ``dflash``, ``window``, ``streaming``, ``yarn``, ``infllm``: the native read (these policies
  change the full-attention layers alone).
- ``fold``: the native read is the local branch, and every context entry outside the row's
  native window (``j <= p - Ws``) is far memory, read at the shared far position of the full
  layers (distance ``D + r``, ``D = window + n_q``) with ``alpha``; the two merge by their masses
  as in Eq. 4 (:func:`fold_sliding_read`: ``fold.attention`` with the layer's ``sliding_window``
  and causality, the same op the full layers and the vLLM backend call). With ``far_budget`` a
  sliding layer's far read is budgeted too (its far memory is what lies outside its native window,
  selected with the same kept page bounds of that layer's cache).
- ``rerope``: the same split, the older entries at distance ``D`` from every row, one softmax,
  queries scaled as in the full layers.
- ``cmr``: the native read over CMR's selection, renumbered (every layer reads the selection).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import fold
from fold.checks import check_float, check_int
from fold.read_options import ReadOptions
from fold.rope import rerope_scale, rotate, work_dtype
from fold.spec_decode.retrieval import CMRRead, InfLLMRead



def plain_read(q, k, v, rope, backend="auto"):
    """Every entry at its true position: FOLD with a window covering the whole cache."""
    return fold.attention(q, k, v, window=k.shape[1], rope=rope, alpha=1.0, backend=backend)


class CachedPlainRead:
    """Every entry at its true position, run as a DFlash engine runs it: each context key is rotated
    once, the first time it is read, and kept; only the block's rows are rotated every round. Same
    math as :func:`plain_read`. Stateful: one per sequence (the context only grows)."""

    def __init__(self, rope: fold.Rope):
        self.rope = rope
        self.rotated: dict[int, torch.Tensor] = {}      # layer -> [Hkv, capacity, d] rotated keys
        self.count: dict[int, int] = {}                 # layer -> context entries rotated so far

    def _rotate(self, x, start, work):
        # x [T, Hkv, d] at positions start .. start + T - 1 -> [Hkv, T, d]
        pos = torch.arange(start, start + x.shape[0], device=x.device)
        return rotate(x.transpose(0, 1).to(work), pos, self.rope)

    def __call__(self, q, k, v, layer):
        _, n_q, heads_q, head_dim = q.shape
        n = k.shape[1] - n_q
        work = work_dtype(q.dtype)
        done = self.count.get(layer, 0)
        buf = self.rotated.get(layer)
        if buf is None or done > n or buf.shape[1] < n or buf.dtype != work:
            done, buf = 0, torch.empty(k.shape[2], max(2 * n, 1024), head_dim, dtype=work, device=k.device)
        if n > done:
            buf[:, done:n] = self._rotate(k[0, done:n], done, work)
        self.rotated[layer], self.count[layer] = buf, n
        keys = torch.cat([buf[:, :n], self._rotate(k[0, n:], n, work)], dim=1)               # [Hkv, L, d]
        qs = self._rotate(q[0], n, work)                                                    # [Hq, n_q, d]
        values = v[0].transpose(0, 1).to(work)                                              # [Hkv, L, d]
        o = torch.nn.functional.scaled_dot_product_attention(qs[None], keys[None], values[None],
                                                             scale=head_dim ** -0.5, enable_gqa=True)
        return o[0].transpose(0, 1)[None].to(q.dtype)


def window_read(q, k, v, *, rope, window, softmax_scale=None, backend="auto"):
    """FOLD without its far memory: row r sees ``j > n + r - D`` at true distances, one softmax."""
    return fold.attention(q, k, v, window=window, rope=rope, far_position="none", softmax_scale=softmax_scale,
                          backend=backend)


def streaming_read(q, k, v, *, rope, sinks=4, recent=2044, backend="auto"):
    """StreamingLLM: sinks and recent entries renumbered consecutively (pre-RoPE cache), block after."""
    n = k.shape[1] - q.shape[1]
    if n <= sinks + recent:
        return plain_read(q, k, v, rope, backend)
    keep = torch.cat([torch.arange(sinks), torch.arange(n - recent, k.shape[1])]).to(k.device)
    return plain_read(q, k[:, keep], v[:, keep], rope, backend)


def yarn_factor(prompt_len: int, max_new_tokens: int, block_size: int, reference_len: int) -> float:
    """The paper's per-request factor ``max(1, ceil((P + G + Q) / 256) * 256 / R)``."""
    return max(1.0, math.ceil((prompt_len + max_new_tokens + block_size) / 256) * 256 / reference_len)


def yarn_rope(rope: fold.Rope, factor: float, reference_len: int, theta: float, beta_fast=32.0, beta_slow=1.0):
    """YaRN (transformers' ramp over dimension index) applied on top of ``rope``'s own inv_freq."""
    if factor <= 1.0:
        return rope
    dim = rope.rotary_dim

    def correction_dim(rotations):
        return dim * math.log(reference_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = rope.inv_freq / factor * (1 - extrapolate) + rope.inv_freq * extrapolate
    mscale = 0.1 * math.log(factor) + 1.0
    return fold.Rope(inv_freq, rotary_dim=dim, interleaved=rope.interleaved,
                     attention_factor=rope.attention_factor * mscale)


def rerope_read(q, k, v, *, rope, window, training_length=4096, backend="auto"):
    """ReRoPE as the paper adapts it: window at true distances, older entries at distance D, one softmax
    (``fold.attention`` with ``far_position="fixed_distance"`` and ``alpha=1``, on either backend)."""
    q = _rerope_scaled(q, k.shape[1] - q.shape[1], training_length)
    return fold.attention(q, k, v, window=window, rope=rope, alpha=1.0, far_position="fixed_distance",
                          backend=backend)


def sliding_state(q, k, v, *, rope, sliding_window, causal, backend="auto"):
    """The native read of a sliding-window layer, as an attention state.

    Row r (position ``p = n + r``) sees entry j iff ``p - j < sliding_window`` and, for a causal
    layer, ``j <= p``; every entry at its true position (``fold.attention``'s local branch alone).
    Returns ``(o [1, n_q, Hq, d] in q's dtype, lse [1, n_q, Hq])``, natural log."""
    return fold.attention(q, k, v, window=0, rope=rope, far_position="none", sliding_window=sliding_window,
                          causal=causal, return_lse=True, backend=backend)


def fold_sliding_read(q, k, v, *, rope, sliding_window, causal, window, **read):
    """FOLD on a sliding-window layer: its native window is the local branch, and every context
    entry outside it is far memory at distance ``D + r`` (``D = window + n_q``), read with
    ``alpha`` and merged by the masses ``Z_N``, ``Z_F = (sum exp(alpha f)) ** (1 / alpha)`` (Eq. 4):
    ``fold.attention`` with the layer's ``sliding_window`` and causality, and ``read`` (``alpha``,
    ``backend``, ``far_budget``, ``far_page``, ``far_rank``, ``far_bounds``: ``fold.attention``'s)."""
    return fold.attention(q, k, v, window=window, rope=rope, sliding_window=sliding_window, causal=causal, **read)


def rerope_sliding_read(q, k, v, *, rope, sliding_window, causal, window, training_length=4096, backend="auto"):
    """ReRoPE on a sliding-window layer: the native window at true distances, every context entry
    outside it at distance ``D`` from every row, one softmax, queries scaled by
    ``max(1, log(p + 1) / log(training_length))``."""
    q = _rerope_scaled(q, k.shape[1] - q.shape[1], training_length)
    return fold.attention(q, k, v, window=window, rope=rope, alpha=1.0, far_position="fixed_distance",
                          sliding_window=sliding_window, causal=causal, backend=backend)


def _rerope_scaled(q, n, training_length):
    work = work_dtype(q.dtype)
    length = torch.tensor([n + q.shape[1]], device=q.device)
    q_scale = rerope_scale(length, q.shape[1], training_length, dtype=work)[0]          # [n_q]
    return (q.to(work) * q_scale[None, :, None, None]).to(q.dtype)


class Read:
    """A policy's read for one sequence, the protocol ``spec_decode.generate`` calls: ``read(q, k, v, layer)``
    for a full-attention layer and ``read.sliding(q, k, v, layer, sliding_window=, causal=)`` for a
    sliding-window layer.

    ``full`` is the full-layer read; ``sliding`` the sliding-layer rule, by default the layer's
    native read (:func:`sliding_state`, which needs ``rope``). ``after_verify`` is forwarded when
    ``full`` has one (CMR). Shapes: ``q [1, n_q, Hq, d]`` pre-RoPE; ``k, v [1, L, Hkv, d]`` pre-RoPE,
    the block's ``n_q`` rows last (row r at position ``L - n_q + r``); returns ``o [1, n_q, Hq, d]``.

    Example (a custom policy for ``spec_decode.generate``: every context entry at its true position, the
    block moved ``shift`` positions further)::

        >>> def shifted(request):
        ...     def read(q, k, v, layer):
        ...         ...                                   # any read returning [1, n_q, Hq, d]
        ...     return fold.spec_decode.Read(read, rope=request["rope"])
        >>> spec_decode.generate(target, drafter, ids, max_new_tokens=64, policy=shifted)
    """

    def __init__(self, full, sliding=None, rope=None):
        self.full = full
        self._sliding = sliding
        self.rope = rope
        if hasattr(full, "after_verify"):
            self.after_verify = full.after_verify

    def __call__(self, q, k, v, layer):
        return self.full(q, k, v, layer)

    def sliding(self, q, k, v, layer, *, sliding_window, causal):
        if self._sliding is not None:
            return self._sliding(q, k, v, layer, sliding_window=sliding_window, causal=causal)
        return sliding_state(q, k, v, rope=self.rope, sliding_window=sliding_window, causal=causal)[0]


OPTIONS = dict(window=2048, alpha=2.0, backend="auto", far_budget=None, far_page=64, far_rank="bound", sinks=4,
               recent=2044, reference_len=4096, rope_theta=None, training_length=4096, infllm_block=128,
               infllm_init=128, infllm_topk=16, infllm_repr=4, cmr_chunk=32, cmr_top=64, cmr_every=8)
_MINIMUM = dict(window=0, sinks=0, recent=0, reference_len=1, training_length=2, infllm_block=1, infllm_init=0,
                infllm_topk=0, infllm_repr=1, cmr_chunk=1, cmr_top=1, cmr_every=1)
_READ = ("alpha", "backend", "far_budget", "far_page", "far_rank")      # fold.attention's: a ReadOptions


def validate_options(options: dict) -> dict:
    """Every policy option checked by name against its range; returns them with the defaults filled in
    (``read``: the :class:`fold.read_options.ReadOptions` of ``alpha``, ``backend`` and the far budget's)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown policy options {unknown}; known: {sorted(OPTIONS)}")
    out = {**OPTIONS, **options}
    for name, low in _MINIMUM.items():
        out[name] = check_int(name, out[name], low, expected=f"an int >= {low}")
    out["read"] = ReadOptions(**{name: out[name] for name in _READ})
    out["rope_theta"] = check_float("rope_theta", out["rope_theta"], 1, open_low=True, none_ok=True,
                                    expected="None or a finite number > 1")
    return out


def _check_far_budget(policy: str, read: ReadOptions, request) -> None:
    """``far_budget`` applies to ``fold`` and must hold every page a block's rows straddle."""
    if policy != "fold":
        raise ValueError(f"far_budget applies to policy='fold' only (the far memory it budgets), got policy={policy!r}")
    read.check_block(request["block_size"] if isinstance(request, dict) and "block_size" in request else 1)


def _check_request(request) -> None:
    if not isinstance(request, dict) or not {"prompt_len", "max_new_tokens", "block_size"} <= set(request):
        raise ValueError(f"request must be dict(prompt_len=, max_new_tokens=, block_size=), got {request!r}")
    for name in ("prompt_len", "max_new_tokens", "block_size"):
        check_int(f"request[{name!r}]", request[name], 1, expected="a positive int")


def make_read(policy: str, rope: fold.Rope, *, request: dict | None = None, **options) -> Read:
    """The read of ``policy`` for one sequence (:data:`POLICIES`; the module docstring has each rule).

    ``request`` = dict(prompt_len, max_new_tokens, block_size): YaRN's per-request factor needs it.
    ``options`` (checked by name and range before any work; defaults in :data:`OPTIONS`):
    ``window`` (int >= 0), ``alpha`` ([1, 1e4]), ``backend`` ("auto", "torch", "triton"), ``far_budget``
    (None or int >= 1; ``fold`` only), ``far_page`` (>= 1, entries per far page) and ``far_rank``
    ("bound" or "keys", how far pages are ranked: ``fold.attention``'s), ``sinks``
    (>= 0), ``recent`` (>= 0), ``reference_len`` (>= 1), ``rope_theta`` (None or > 1),
    ``training_length`` (>= 2), ``infllm_block`` (>= 1), ``infllm_init`` (>= 0), ``infllm_topk``
    (>= 0), ``infllm_repr`` (>= 1), ``cmr_chunk``, ``cmr_top``, ``cmr_every`` (>= 1).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {BUILT}, got {policy!r}")
    if not isinstance(rope, fold.Rope):
        raise TypeError(f"rope must be a fold.Rope, got {type(rope).__name__}")
    o = validate_options(options)
    if o["far_budget"] is not None:
        _check_far_budget(policy, o["read"], request)
    entry = POLICIES[policy]
    full = entry.full(rope, o, request)
    return Read(full, None if entry.sliding is None else entry.sliding(rope, o, full), rope=rope)


class PageBounds:
    """Per-page key bounds of one sequence's drafter cache, layer by layer: the ``far_bounds`` that
    ``fold.attention(..., far_budget=)`` selects far pages by, kept as cache metadata.

    For layer ``i`` it holds ``[1, pages, heads_kv, 2, head_dim]`` float32 (``[..., 0, :]`` the
    elementwise max, ``[..., 1, :]`` the min of the pre-RoPE keys of page ``t = entries [t P, (t + 1) P)``).
    :meth:`bounds` folds in only the committed entries appended since its last call
    (``fold.far_pages.update_bounds``: O(new entries), never the whole cache). The block's own rows
    (written after the committed ones for one round) are left out: they are never far, and the entries
    that replace them are folded in once committed. A cache seen shorter than before was truncated
    (:meth:`truncate`). Stateful: one per sequence.
    """

    def __init__(self, far_page: int):
        self.far_page = far_page
        self.pages: dict[int, torch.Tensor] = {}     # layer -> [1, capacity pages, Hkv, 2, d] float32
        self.count: dict[int, int] = {}              # layer -> committed entries folded in

    def bounds(self, layer: int, k: torch.Tensor, n: int) -> torch.Tensor:
        """``k [1, L, Hkv, d]`` the layer's pre-RoPE cache whose first ``n`` entries are committed ->
        its bounds ``[1, ceil(L / P), Hkv, 2, d]`` (a view of the kept tensor)."""
        from fold.far_pages import empty_bounds, update_bounds

        pages = -(-k.shape[1] // self.far_page)
        buf, done = self.pages.get(layer), self.count.get(layer, 0)
        if buf is None or buf.shape[1] < pages or buf.device != k.device:
            grown = empty_bounds(max(pages, 2 * buf.shape[1] if buf is not None else pages), k.shape[2], k.shape[3],
                                 batch=1, device=k.device)
            if buf is not None and buf.device == k.device:
                grown[:, :buf.shape[1]] = buf
            else:
                done = 0
            buf = grown
        if n < done:
            self.pages[layer], self.count[layer] = buf, done
            self.truncate(n, layer)
            done = n
        if n > done:
            positions = torch.arange(done, n, device=k.device)
            update_bounds(buf, k[0, done:n], far_page=self.far_page, positions=positions,
                          batch_index=torch.zeros_like(positions))
        self.pages[layer], self.count[layer] = buf, n
        return buf[:, :pages]

    def truncate(self, length: int, layer: int | None = None) -> None:
        """Keep the bounds valid for a cache cut back to ``length`` entries (every layer, or ``layer``):
        pages wholly past it are emptied (``(-inf, +inf)``); the page ``length`` falls inside keeps its
        box, looser than exact but still a bound of what remains (a box may be larger than its keys'
        extent, never smaller: with a budget covering every page the read is exact whatever the boxes,
        and a page later rewritten from its offset 0 starts a fresh box, ``update_bounds``' rule)."""
        for i in ([layer] if layer is not None else list(self.pages)):
            if self.count.get(i, 0) > length:
                first_empty = -(-length // self.far_page)
                self.pages[i][:, first_empty:, :, 0] = float("-inf")
                self.pages[i][:, first_empty:, :, 1] = float("inf")
                self.count[i] = length


class FoldRead:
    """FOLD on full-attention layers: ``fold.attention`` once anything is far, the plain read (each
    context key rotated once, as an engine caches it) while the sequence fits in the window.

    With ``far_budget`` N the far branch reads at most ``N // far_page`` pages of ``far_page``
    entries, chosen by the per-page key bounds (:class:`PageBounds`, kept per sequence as the cache
    grows); ``far_budget=None`` reads every far entry."""

    def __init__(self, rope: fold.Rope, window: int, read: ReadOptions):
        self.rope, self.window, self.read = rope, window, read
        self.short = CachedPlainRead(rope)
        self.page_bounds = None if read.far_budget is None else PageBounds(read.far_page)

    def options(self, k, n: int, layer: int) -> dict:
        """``fold.attention``'s read options for layer ``layer``'s cache ``k`` (``n`` committed): :attr:`read`,
        and with a budget the kept bounds."""
        bounds = None if self.page_bounds is None else self.page_bounds.bounds(layer, k, n)
        return dict(asdict(self.read), far_bounds=bounds)

    def __call__(self, q, k, v, layer):
        n = k.shape[1] - q.shape[1]
        if n <= self.window:                                # length dispatch: nothing is far yet
            return self.short(q, k, v, layer)
        return fold.attention(q, k, v, window=self.window, rope=self.rope, **self.options(k, n, layer))

    def sliding(self, q, k, v, layer, *, sliding_window, causal):
        """A sliding-window layer's FOLD read (:func:`fold_sliding_read`), budgeted like the full layers."""
        return fold_sliding_read(q, k, v, rope=self.rope, sliding_window=sliding_window, causal=causal,
                                 window=self.window, **self.options(k, k.shape[1] - q.shape[1], layer))


def _yarn(rope, o, request):
    _check_request(request)
    factor = yarn_factor(request["prompt_len"], request["max_new_tokens"], request["block_size"], o["reference_len"])
    if o["rope_theta"] is None and rope.inv_freq.numel() < 2:
        raise ValueError("yarn needs rope_theta=... for a rotary_dim of 2 (it cannot be read off inv_freq)")
    # inv_freq[i] = theta ** (-2i / rotary_dim), so theta = inv_freq[1] ** (-rotary_dim / 2)
    theta = o["rope_theta"] if o["rope_theta"] is not None else float(rope.inv_freq[1]) ** (-rope.rotary_dim / 2)
    return CachedPlainRead(yarn_rope(rope, factor, o["reference_len"], theta))


def _cmr_sliding(rope, o, cmr):
    def read(q, k, v, layer, *, sliding_window, causal):            # the native read over CMR's selection
        n = k.shape[1] - q.shape[1]
        keep = torch.cat([cmr.entries(n).to(k.device), torch.arange(n, k.shape[1], device=k.device)])
        return sliding_state(q, k[:, keep], v[:, keep], rope=rope, sliding_window=sliding_window, causal=causal)[0]
    return read


@dataclass(frozen=True)
class Policy:
    """A context policy: ``full(rope, options, request)`` is the read of full-attention layers for one
    sequence, ``sliding(rope, options, full_read)`` the rule of its sliding-window layers, a
    ``read(q, k, v, layer, *, sliding_window, causal)`` (``None``: their native read,
    :func:`sliding_state`)."""

    full: Callable
    sliding: Callable | None = None


# Every policy, its read on full-attention layers and on sliding-window layers, in one place.
POLICIES = {
    "dflash": Policy(full=lambda rope, o, request: CachedPlainRead(rope)),
    "window": Policy(full=lambda rope, o, request: lambda q, k, v, layer: window_read(
        q, k, v, rope=rope, window=o["window"], backend=o["backend"])),
    "fold": Policy(full=lambda rope, o, request: FoldRead(rope, o["window"], o["read"]),
                   sliding=lambda rope, o, full: full.sliding),
    "streaming": Policy(full=lambda rope, o, request: lambda q, k, v, layer: streaming_read(
        q, k, v, rope=rope, sinks=o["sinks"], recent=o["recent"], backend=o["backend"])),
    "yarn": Policy(full=_yarn),
    "rerope": Policy(full=lambda rope, o, request: lambda q, k, v, layer: rerope_read(
        q, k, v, rope=rope, window=o["window"], training_length=o["training_length"], backend=o["backend"]),
                     sliding=lambda rope, o, full: lambda q, k, v, layer, **kw: rerope_sliding_read(
                         q, k, v, rope=rope, window=o["window"], training_length=o["training_length"],
                         backend=o["backend"], **kw)),
    "infllm": Policy(full=lambda rope, o, request: InfLLMRead(rope, window=o["window"], block=o["infllm_block"],
                                                              init=o["infllm_init"], topk=o["infllm_topk"],
                                                              repr_topk=o["infllm_repr"])),
    "cmr": Policy(full=lambda rope, o, request: CMRRead(rope, chunk=o["cmr_chunk"], top=o["cmr_top"],
                                                        every=o["cmr_every"], backend=o["backend"]),
                  sliding=_cmr_sliding),
}
BUILT = tuple(POLICIES)
