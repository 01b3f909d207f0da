"""Shared test helpers: inputs, and tolerances scaled to PyTorch's own error in each dtype."""

import sys
from dataclasses import dataclass, replace

import torch
from hypothesis import settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import fold
from fold.kernels.fold_attention import FoldConfig
from reference import apply_rope, fold_attention_ref
from reference.tolerance import check_close as assert_close  # noqa: F401 (re-exported for the tests)


# The Triton kernels run in the interpreter here, ~1-2 s an example: the three kernel-vs-reference
# sweeps draw a third of the profile's examples (20 in CI, 100 with HYPOTHESIS_PROFILE=thorough),
# which keeps the suite within its 10 minutes; their @example cases always run.
INTERPRETED = settings(max_examples=max(10, settings.default.max_examples // 3))


@dataclass(frozen=True)
class Case:
    batch: int = 1
    n_q: int = 4
    heads_kv: int = 1
    group: int = 1
    head_dim: int = 32
    rotary_dim: int = 32
    interleaved: bool = False
    attention_factor: float = 1.0
    max_len: int = 64
    seqlens: tuple | None = None
    window: int = 16
    alpha: float = 2.0
    keys_rotated: bool = False
    queries_rotated: bool = False
    far_position: str = "shared"
    sliding_window: int | None = None
    causal: bool = False
    softcap: float | None = None
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def with_(self, **kw):
        return replace(self, **kw)


def rope_of(case: Case) -> fold.Rope:
    inv_freq = fold.Rope.from_theta(10000.0, case.head_dim, rotary_dim=case.rotary_dim).inv_freq
    return fold.Rope(inv_freq, interleaved=case.interleaved, attention_factor=case.attention_factor)


def make_inputs(case: Case, pad=float("nan")):
    """q, k, v in ``case.dtype``; padding beyond each sequence's length is ``pad``; with
    ``keys_rotated`` the cache holds ``R_j k_j``, with ``queries_rotated`` q holds ``R_{n+r} q``."""
    g = torch.Generator().manual_seed(case.seed)
    heads_q = case.heads_kv * case.group
    q = torch.randn(case.batch, case.n_q, heads_q, case.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(case.batch, case.max_len, case.heads_kv, case.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(case.batch, case.max_len, case.heads_kv, case.head_dim, generator=g, dtype=torch.float64)
    if case.keys_rotated:
        rope = rope_of(case)
        k = apply_rope(k, torch.arange(case.max_len)[None, :, None], rope.inv_freq, rotary_dim=rope.rotary_dim,
                       interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    if case.queries_rotated:
        rope = rope_of(case)
        lengths = case.seqlens or (case.max_len,) * case.batch
        p = torch.tensor(lengths)[:, None] - case.n_q + torch.arange(case.n_q)[None, :]      # [batch, n_q]
        q = apply_rope(q, p[:, :, None], rope.inv_freq, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved,
                       attention_factor=rope.attention_factor)
    q, k, v = (x.to(case.dtype) for x in (q, k, v))
    seqlens = None
    if case.seqlens is not None:
        seqlens = torch.tensor(case.seqlens, dtype=torch.int32)
        for b, length in enumerate(case.seqlens):
            k[b, length:] = pad
            v[b, length:] = pad
    return q, k, v, seqlens


def kwargs_of(case: Case, seqlens):
    return dict(window=case.window, rope=rope_of(case), alpha=case.alpha, cache_seqlens=seqlens,
                keys_rotated=case.keys_rotated, queries_rotated=case.queries_rotated, far_position=case.far_position,
                sliding_window=case.sliding_window, causal=case.causal, softcap=case.softcap)


def reference_pair(case: Case, q, k, v, seqlens):
    """(truth in float64, the same math in case.dtype) for out and lse."""
    kw = kwargs_of(case, seqlens)
    return fold_attention_ref(q, k, v, **kw, upcast=True), fold_attention_ref(q, k, v, **kw, upcast=False)


def check_against_reference(case: Case, backend: str):
    q, k, v, seqlens = make_inputs(case)
    out, lse = fold.attention(q, k, v, **kwargs_of(case, seqlens), return_lse=True, backend=backend)
    assert out.dtype == case.dtype and out.shape == q.shape
    assert lse.shape == q.shape[:3]
    (out64, lse64), (out_lp, lse_lp) = reference_pair(case, q, k, v, seqlens)
    assert_close("out", out, out64, out_lp, case.dtype)
    assert_close("lse", lse, lse64, lse_lp, case.dtype)


class HostReads(TorchFunctionMode):
    """Records every call that reads a tensor's values on the host (``.item()``, ``.tolist()``,
    ``bool()``/``int()``/``float()`` of a tensor, ``nonzero``, boolean-mask indexing, ``.cpu()``,
    ``.numpy()``): on a GPU each is a sync that a CUDA graph cannot capture. fold's custom ops run
    their implementation inside the mode (the dispatcher would hide it); calls made by Triton's
    interpreter itself are not fold's and are left out. ``calls``: ``(name, calling module)``."""

    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy,
             torch.Tensor.cpu, torch.Tensor.masked_select, torch.masked_select}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __enter__(self):
        import fold.ops as ops

        self._ops, self._real = ops, (ops.attention_op, ops.tree_attention_op)
        ops.attention_op, ops.tree_attention_op = ops.attention_op._init_fn, ops.tree_attention_op._init_fn
        return super().__enter__()

    def __exit__(self, *exc):
        self._ops.attention_op, self._ops.tree_attention_op = self._real
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        index = args[1] if func is torch.Tensor.__getitem__ and len(args) > 1 else ()
        masks = any(isinstance(x, torch.Tensor) and x.dtype == torch.bool
                    for x in (index if isinstance(index, tuple) else (index,)))
        if (func in self.SYNCS or masks) and not caller.startswith(("triton", "numpy")):
            self.calls.append((getattr(func, "__name__", str(func)), caller))
        return func(*args, **(kwargs or {}))


def to_pages(x, seqlens, page_size, generator, spare=3):
    """A contiguous cache ``x [B, max_len, H, d]`` as shuffled pages with garbage in every unused slot:
    ``(pages [num_blocks, page_size, H, d], block_table [B, max_blocks] int32)``."""
    batch, max_len = x.shape[:2]
    max_blocks = -(-max_len // page_size)
    num_blocks = batch * max_blocks + spare
    pages = torch.randn(num_blocks, page_size, *x.shape[2:], generator=generator).to(x.dtype) * 1e3   # garbage
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.full((batch, max_blocks), -7, dtype=torch.int32)          # unused entries: garbage too
    for b in range(batch):
        used = -(-int(seqlens[b]) // page_size)
        for p in range(used):
            block = int(order[b * max_blocks + p])
            table[b, p] = block
            rows = x[b, p * page_size:min((p + 1) * page_size, int(seqlens[b]))]
            pages[block, :len(rows)] = rows
    return pages, table


# hypothesis strategies shared by the attention tests
@st.composite
def cases(draw, dtypes, max_len_cap=2500):
    n_q = draw(st.sampled_from([1, 4, 7, 10, 16]))
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    rotary_dim = draw(st.one_of(st.just(head_dim), st.integers(1, head_dim // 2).map(lambda x: 2 * x)))
    # mostly short caches (cheap in the interpreter), sometimes a few thousand entries
    max_len = draw(st.one_of(st.integers(n_q, 160), st.integers(n_q, max_len_cap)))
    batch = draw(st.integers(1, 3))
    seqlens = draw(st.one_of(st.none(), st.lists(st.integers(n_q, max_len), min_size=batch, max_size=batch).map(tuple)))
    length = max_len if seqlens is None else max(seqlens)
    window = draw(st.one_of(st.integers(0, 48), st.integers(0, length + 8)))
    # a sliding-window layer's rule now and then: its native window (>= n_q) as the local branch
    sliding = draw(st.one_of(st.none(), st.none(), st.integers(n_q, n_q + 40), st.integers(n_q, length + 8)))
    return Case(
        batch=batch, n_q=n_q, heads_kv=draw(st.integers(1, 2)), group=draw(st.integers(1, 8)),
        head_dim=head_dim, rotary_dim=rotary_dim, interleaved=draw(st.booleans()),
        attention_factor=draw(st.sampled_from([1.0, 1.0, 1.25])), max_len=max_len, seqlens=seqlens,
        window=window, alpha=draw(st.floats(1.0, 8.0)), keys_rotated=draw(st.booleans()),
        queries_rotated=draw(st.booleans()),
        far_position=draw(st.sampled_from(["shared", "shared", "fixed_distance", "none"])),
        sliding_window=sliding, causal=draw(st.booleans() if sliding is not None else st.sampled_from([False] * 3 + [True])),
        softcap=draw(st.one_of(st.none(), st.none(), st.none(), st.floats(0.5, 30.0))),
        dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)),
    )


configs = st.builds(FoldConfig, block_m=st.sampled_from([16, 32, 64, 128]), block_n=st.sampled_from([16, 32, 64, 128]),
                    num_splits=st.sampled_from([1, 2, 3, 4, 8, 16, 128]), num_warps=st.just(4), num_stages=st.just(2))


class Recorder:
    """Wraps ``cls.name`` for the duration of a ``with`` block, keeping ``keep(obj, args, kwargs, result)``
    of every call in :attr:`calls` (an inherited method is wrapped on ``cls`` and removed again after)."""

    def __init__(self, cls, name, keep):
        self.cls, self.name, self.keep, self.calls = cls, name, keep, []

    def __enter__(self):
        self.own = self.cls.__dict__.get(self.name)
        original, keep, calls = getattr(self.cls, self.name), self.keep, self.calls

        def wrapped(obj, *args, **kwargs):
            result = original(obj, *args, **kwargs)
            calls.append(keep(obj, args, kwargs, result))
            return result

        setattr(self.cls, self.name, wrapped)
        return self

    def __exit__(self, *exc):
        if self.own is None:
            delattr(self.cls, self.name)
        else:
            setattr(self.cls, self.name, self.own)


def dense_cache(k_pages, v_pages, block_table, seq_lens, scales=(1.0, 1.0)) -> torch.Tensor:
    """Key and value pages ``[num_blocks, page, heads_kv, d]`` read back per sequence through
    ``block_table`` -> ``[2, batch, max(seq_lens), heads_kv, d]`` float32, times ``scales`` (FP8), NaN
    past each sequence's length."""
    page = k_pages.shape[1]
    dense = torch.full((2, len(seq_lens), max(seq_lens), *k_pages.shape[2:]), float("nan"))
    for b, length in enumerate(seq_lens):
        j = torch.arange(length)
        pages = block_table[b, j // page].long()
        dense[0, b, :length] = k_pages[pages, j % page].float() * scales[0]
        dense[1, b, :length] = v_pages[pages, j % page].float() * scales[1]
    return dense
