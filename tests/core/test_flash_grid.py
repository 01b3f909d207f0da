"""flash-attention's kvcache grid, ported: ``fold.attention_with_kvcache`` read as plain attention (issue 43).

flash-attention's ``test_flash_attn_kvcache`` (``tests/test_flash_attn.py``) is the grid its users trust for
decode attention over a cache. This is our own port of its product against fold's append form read with
``far_position="none"`` (no far memory: plain attention over each sequence's ``[leftpad, cache_seqlens +
n_new)``), judged as flash-attention judges itself (``reference.tolerance.check_flash_rule``: at most 3x
PyTorch's own error in the same dtype + 1e-5) on the output and on the LSE, and the cache after the write.

Crossed as there: dtype, MHA / MQA / GQA, new rows appended or not (as many as the queries or fewer), local
and causal masks, interleaved and partial rotary (rotary only with new rows, as there), a paged cache,
``cache_leftpad``, ``cache_batch_idx``, head dims 32-256, and its eleven ``(seqlen_q, seqlen_k)`` pairs up
to 128K. Mapped to fold's terms (``docs/flash-attn-kvcache.md`` lists every argument):

- ``window_size=(left, right)`` -> ``sliding_window = left + 1`` (fold needs it ``>= seqlen_q``); ``right`` is
  0 with ``causal`` and the sequence's end without (fold's block is bidirectional);
- ``rotary_cos``/``rotary_sin`` of arbitrary angles -> a :class:`fold.Rope` of random frequencies (angles
  linear in the position), positions counted from ``cache_leftpad``, every query row at its own position
  (flash-attention turns all rows of a non-causal call by ``cache_seqlens``);
- every sequence holds at least ``seqlen_q`` entries (fold's domain; flash-attention lets a row see none);
- fp32 is crossed too, a page size of 16 beside 256; ``alibi_slopes`` (fold has no ALiBi) and
  ``num_splits`` (fold chooses its own split) are not.

The truth is plain attention in float64 written out below (``reference.fold_attention_ref`` is the same
read, but computes the far branch of every entry and repeats the KV heads: ~13 GB at 128K and d 256); the
PyTorch error is the same code in the input dtype.

What runs: ``SHARE`` cases drawn with a fixed seed on the torch path (the default suite; caches up to 256 MiB,
every value of every axis among them), ``TRITON_SHARE`` through Triton's interpreter (fp16/fp32, contexts up
to 1024), and the whole product with ``-m flash_grid`` (157K cases, about a day of one CPU core; the largest,
a 2 GiB cache, peaks at 9 GB of memory, so give each xdist worker that much).
"""

import itertools
import math
import random
import zlib

import pytest
import torch

import fold
from fold.config_lookup import use_config
from fold.kernels.fold_attention import FoldConfig
from reference import apply_rope
from reference.tolerance import check_flash_rule
from tests.helpers import INTERPRETED  # noqa: F401 (importing it sets up the interpreter's settings)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEQLENS = ((1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
           (1, 128 * 1024), (16, 128 * 1024), (128, 128))
AXES = dict(dtype=DTYPES, mha=("mha", "mqa", "gqa"), new_kv=(False, True), local=(False, True),
            causal=(False, True), new_eq_q=(True, False), interleaved=(False, True), rotary=(0.0, 0.5, 1.0),
            page=(None, 16, 256), leftpad=(False, True), batch_idx=(False, True), d=(32, 59, 64, 80, 128, 256),
            seqlens=SEQLENS)
SHARE, TRITON_SHARE, SEED = 120, 10, 43
BATCH, HEADS = 2, 6


def _name(case):
    parts = []
    for key, value in case.items():
        if isinstance(value, bool):
            parts.append(key if value else f"no_{key}")
        elif isinstance(value, str):
            parts.append(value)
        elif key == "dtype":
            parts.append(str(value).removeprefix("torch."))
        elif key == "seqlens":
            parts.append(f"q{value[0]}k{value[1]}")
        else:
            parts.append(f"{key}{value}")
    return "-".join(parts)


def _grid():
    """Every case of the product that flash-attention runs too (its skips), in a fixed order."""
    cases = []
    for values in itertools.product(*AXES.values()):
        c = dict(zip(AXES, values))
        seqlen_q, seqlen_k = c["seqlens"]
        if (c["new_kv"] and seqlen_q > seqlen_k) or (not c["new_kv"] and c["rotary"] > 0):
            continue
        if c["page"] is not None and (c["batch_idx"] or c["leftpad"]):
            continue
        if not c["new_kv"] and not c["new_eq_q"]:          # no new rows: their count means nothing
            continue
        if c["rotary"] == 0 and c["interleaved"]:           # nothing rotates: the pairing means nothing
            continue
        cases.append(c)
    return cases


def _share(indices, size, rng):
    """``size`` cases of ``indices`` drawn by ``rng``, every value of every axis among them where it can be:
    first cases that bring a value not yet held, then the rest of the draw."""
    order = rng.sample(indices, len(indices))
    held, share = set(), []
    for i in order:
        new = {(key, str(value)) for key, value in GRID[i].items()} - held
        if new and len(share) < size:
            share.append(i)
            held |= new
    return share + [i for i in order if i not in share][:size - len(share)]


def _cache_bytes(c):
    rows = 5 if c["batch_idx"] else BATCH
    heads_kv = {"mha": HEADS, "mqa": 1, "gqa": 3}[c["mha"]]
    return rows * c["seqlens"][1] * heads_kv * c["d"] * c["dtype"].itemsize


GRID = _grid()
_rng = random.Random(SEED)
# the default share: caches up to 256 MiB each (a 2 GiB one takes 9 GB and 45 s; -m flash_grid runs them)
SAMPLE = _share([i for i, c in enumerate(GRID) if _cache_bytes(c) <= 2**28], SHARE, _rng)
TRITON_SAMPLE = _share([i for i, c in enumerate(GRID) if c["dtype"] != torch.bfloat16      # bf16: GPU only
                        and c["seqlens"][1] <= 1024], TRITON_SHARE, _rng)


def _build(c):
    """The case's inputs, drawn from a generator seeded by its name: q, the caches as fold takes them (NaN
    wherever no sequence has an entry), k, v, fold's arguments, and the truth's view (dense sequences)."""
    g = torch.Generator().manual_seed(zlib.crc32(_name(c).encode()))
    dtype, d = c["dtype"], c["d"]
    seqlen_q, seqlen_k = c["seqlens"]
    heads_kv = {"mha": HEADS, "mqa": 1, "gqa": 3}[c["mha"]]
    n_new = 0 if not c["new_kv"] else seqlen_q if c["new_eq_q"] else int(torch.randint(1, seqlen_q + 1, (1,),
                                                                                          generator=g))
    q = torch.randn(BATCH, seqlen_q, HEADS, d, generator=g).to(dtype)
    k_new = torch.randn(BATCH, n_new, heads_kv, d, generator=g).to(dtype)
    v_new = torch.randn(BATCH, n_new, heads_kv, d, generator=g).to(dtype)
    # before the write: entries end at `ends`, start at `starts`; after it each sequence holds >= seqlen_q
    low = max(seqlen_q - n_new, 0 if c["new_kv"] else 1)
    ends = torch.randint(low, seqlen_k - n_new + 1, (BATCH,), generator=g)
    starts = torch.zeros_like(ends)
    if c["leftpad"]:
        starts = torch.stack([torch.randint(0, int(e) + n_new - seqlen_q + 1, (1,), generator=g)[0] for e in ends])
    rows = 5 if c["batch_idx"] else BATCH
    order = torch.randperm(rows, generator=g)[:BATCH] if c["batch_idx"] else torch.arange(BATCH)
    dense = [torch.randn(2, int(e - s), heads_kv, d, generator=g).to(dtype) for s, e in zip(starts, ends)]
    window = None
    if c["local"]:
        window = int(torch.randint(seqlen_q, seqlen_k + 1, (1,), generator=g))
    rotary_dim = int(c["rotary"] * d) // 16 * 16
    rope = fold.Rope.from_theta(10000.0, 16)                 # rotates nothing unless rotary_dim > 0
    if rotary_dim:
        inv_freq = torch.rand(rotary_dim // 2, generator=g) * 2 * math.pi / 8
        rope = fold.Rope(inv_freq, rotary_dim, interleaved=c["interleaved"])

    args = dict(cache_seqlens=ends.to(torch.int32), window=seqlen_k, rope=rope, rotate_new_keys=rotary_dim > 0,
                far_position="none", keys_rotated=True, queries_rotated=rotary_dim == 0, causal=c["causal"],
                sliding_window=window)
    if c["page"] is None:
        shape = (rows, seqlen_k, heads_kv, d)
        k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
        for b in range(BATCH):
            k_cache[order[b], starts[b]:ends[b]], v_cache[order[b], starts[b]:ends[b]] = dense[b]
        if c["batch_idx"]:
            args["cache_batch_idx"] = order.to(torch.int32)
        if c["leftpad"]:
            args["cache_leftpad"] = starts.to(torch.int32)
    else:                                                    # flash-attention's: 3x the pages needed, shuffled
        page = c["page"]
        per_seq = -(-seqlen_k // page)
        blocks = 3 * BATCH * per_seq
        table = torch.randperm(blocks, generator=g)[:BATCH * per_seq].view(BATCH, per_seq)
        k_cache = torch.full((blocks, page, heads_kv, d), float("nan"), dtype=dtype)
        v_cache = k_cache.clone()
        for b in range(BATCH):
            index = torch.arange(int(ends[b]))
            k_cache[table[b, index // page], index % page], v_cache[table[b, index // page], index % page] = dense[b]
        args["block_table"] = table.to(torch.int32)
    return q, k_cache, v_cache, k_new if n_new else None, v_new if n_new else None, args, dict(
        dense=dense, starts=starts, ends=ends, order=order, n_new=n_new, rotary_dim=rotary_dim)


def _where(args, order, page, b, index):
    """(cache row, column) of sequence b's cache index ``index`` (a tensor of indices): through the block
    table in pages of ``page`` entries, else in row ``order[b]``."""
    table = args.get("block_table")
    if table is not None:
        return table[b].long()[index // page], index % page
    return order[b].expand_as(index), index


def _fingerprint(cache):
    """One float64 number per cache slot [rows, slots] that changes when any of its elements does (a
    weighted sum, NaN counted as 7): the cache of a 128K case is GBs, a copy of it twice that."""
    weights = torch.arange(1, cache.shape[2] * cache.shape[3] + 1, dtype=torch.float64).sqrt()
    return torch.stack([(row.flatten(1).double().nan_to_num(7.0) * weights).sum(-1) for row in cache])


def _plain_attention(q, keys, values, *, causal, window, upcast):
    """flash-attention's ``attention_ref`` for one sequence: q [s, Hq, d] (rotated) over keys/values [L, Hkv, d],
    row i at position L - s + i; ``window``: it sees ``p - j < window``; ``causal``: no entry after its own.
    Returns (out [s, Hq, d], lse [s, Hq]) in float64 with ``upcast``, else in the inputs' dtype."""
    dtype = torch.float64 if upcast else q.dtype
    s, heads, d = q.shape
    length, heads_kv = keys.shape[:2]
    qg = q.to(dtype).view(s, heads_kv, heads // heads_kv, d)
    scores = torch.einsum("shgd,jhd->hgsj", qg * d ** -0.5, keys.to(dtype))
    behind = (length - s + torch.arange(s))[:, None] - torch.arange(length)[None, :]
    visible = torch.ones_like(behind, dtype=torch.bool)
    if causal:
        visible &= behind >= 0
    if window is not None:
        visible &= behind < window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                   # [Hkv, g, s]
    out = torch.einsum("hgsj,jhd->shgd", torch.softmax(scores, dim=-1), values.to(dtype))
    return out.reshape(s, heads, d), lse.permute(2, 0, 1).reshape(s, heads)


def run_case(c, backend):
    q, k_cache, v_cache, k, v, args, truth = _build(c)
    before = (_fingerprint(k_cache), _fingerprint(v_cache))
    out, lse = fold.attention_with_kvcache(q, k_cache, v_cache, k, v, **args, return_lse=True, backend=backend)
    rope, rotary_dim, n_new = args["rope"], truth["rotary_dim"], truth["n_new"]
    rot = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved)
    seqlen_q = q.shape[1]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(BATCH):
        start, end = int(truth["starts"][b]), int(truth["ends"][b])
        keys, values = truth["dense"][b]
        if n_new:                                            # the new rows, where and as they must be written
            index = torch.arange(end, end + n_new)
            row, col = _where(args, truth["order"], k_cache.shape[1], b, index)
            written[row, col] = True
            new_k = k[b]
            if rotary_dim:
                exact = apply_rope(new_k.double(), (index - start)[:, None], rope.inv_freq, **rot)
                in_dtype = apply_rope(new_k, (index - start)[:, None], rope.inv_freq, **rot)
                check_flash_rule(f"sequence {b}: written keys", k_cache[row, col], exact, in_dtype)
                new_k = k_cache[row, col]
            else:
                assert torch.equal(k_cache[row, col], new_k), f"sequence {b}: written keys"
            assert torch.equal(v_cache[row, col], v[b]), f"sequence {b}: written values"
            keys, values = torch.cat([keys, new_k]), torch.cat([values, v[b]])
        length = end + n_new - start
        qb = q[b]
        if rotary_dim:                                       # row r at position length - seqlen_q + r
            positions = (length - seqlen_q + torch.arange(seqlen_q))[:, None]
            q64 = apply_rope(qb.double(), positions, rope.inv_freq, **rot)
            q_lp = apply_rope(qb, positions, rope.inv_freq, **rot)
        else:
            q64 = q_lp = qb
        mask = dict(causal=c["causal"], window=args["sliding_window"])
        want, want_lse = _plain_attention(q64, keys, values, upcast=True, **mask)
        lp, lp_lse = _plain_attention(q_lp, keys, values, upcast=False, **mask)
        check_flash_rule(f"sequence {b}: out", out[b], want, lp)
        check_flash_rule(f"sequence {b}: lse", lse[b], want_lse, lp_lse)
    for name, after, old in (("k_cache", k_cache, before[0]), ("v_cache", v_cache, before[1])):
        assert torch.equal(_fingerprint(after)[~written], old[~written]), f"{name} changed outside the new rows"


@pytest.mark.parametrize("index", SAMPLE, ids=lambda i: _name(GRID[i]))
def test_torch_path_on_a_share_of_the_grid(index):
    run_case(GRID[index], "torch")


@pytest.mark.parametrize("index", TRITON_SAMPLE, ids=lambda i: _name(GRID[i]))
def test_triton_on_a_share_of_the_grid(index):
    with use_config(FoldConfig(16, 16, 2, 4, 2)):
        run_case(GRID[index], "triton")


CHUNKS = 200


@pytest.mark.flash_grid
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_torch_path_on_the_whole_grid(chunk):
    """The whole product, in ``CHUNKS`` slices (``-m flash_grid``; ``-n`` spreads them over cores)."""
    for c in GRID[chunk::CHUNKS]:
        run_case(c, "torch")

