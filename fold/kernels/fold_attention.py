"""Fused FOLD attention in Triton: configs -> jit kernels -> launcher.

Four launches, each of one kernel:

- **prologue** (one program per KV head and row tile): each branch's query, rotated at its position,
  written once in the cache's dtype (unscaled: ``softmax_scale * log2(e)``, and ``alpha`` for the far
  branch, multiply the float32 logits after the dot, so no rounded product of them reaches the LSE);
  and the cos/sin of ``i * inv_freq`` for the offsets ``i`` of a key tile.
- **stage 1, window** and **stage 1, far memory**: the same kernel specialised per branch (so each
  has its own register budget), over ``(batch * heads_kv * m_tiles, splits)`` programs. A program
  owns ``BLOCK_M`` rows (draft row x GQA head, so each KV tile is loaded once per KV head) and a
  contiguous, ``BLOCK_N``-aligned share of its branch's tiles (balanced to one tile), and writes one
  partial state per row. Each KV tile is one ``[BLOCK_N, D]`` K and V load and one full-width QK dot.
  The far launch is left out when no sequence can have far entries (``max_len - n_q <= W``).
- **stage 2**, one program per output row: merges the window states as they are and the far states
  in alpha-space (their LSE is ``LSE(alpha * logits)``), divides the far LSE by alpha and merges the
  two branches, :data:`MERGE_BLOCK_S` states at a time (registers bounded for any split count).

Per sequence (``L`` entries, ``n = L - n_q``, ``D = W + n_q``, ``win_lo = n - D + 1``) row ``r``
reads ``j < win_lo + r`` as far memory and ``j >= win_lo + r`` as window. The far launch covers
``j < n - W`` and the window launch ``j >= win_lo``, so only ``n_q - 1`` entries are read twice.
The far loop is a plain flash-decoding loop without masks up to its last whole tile below
``win_lo``; its masked tail (at most two tiles) and the window loop (``W + 2 n_q`` entries at most)
mask rows. A split with nothing to read stores only its LSE (``-inf``); stage 2 never loads the
``o`` of a state whose weight is zero.

Exactly one branch rotates keys: the window with an unrotated cache (``R_j k``), the far memory
with a rotated one (``R_{-j} R_j k``), in tiles of at most :data:`ROT_BLOCK_N` entries. It splits the
loaded ``[BLOCK_N, D]`` tile into the two rotary halves in registers (pass-through dimensions and
partial rotary: pairs of frequency 0, loaded by column maps), rotates them with
``cos/sin((t0 + i) f) = cos/sin(t0 f) (x) cos/sin(i f)`` (``t0 f`` per tile, ``i f`` from the
prologue's table) and joins them back into one tile. Every angle is reduced exactly in float64 before
a float32 polynomial (:func:`_cos_sin`): no libdevice ``sin``/``cos``, so no slow path with a local
array, and both key layouts see exact angles at any context length.

:func:`plain_attention_fwd` is the plain read (every row over every valid entry, queries and keys
as given: ``fold.tree_attention``'s cached read): one stage-1 launch (``PLAIN``: no prologue, q read
in place, the far memory's loop over ``[0, L)``) and stage 2.

``softcap`` (Gemma-style logit soft-capping, ``SOFTCAP``): each logit ``x = q.k * scale`` becomes
``softcap * tanh(x / softcap)`` before the far branch's ``alpha`` (:func:`_soft_cap`, exact in float32
to a few ulp without libdevice).

Partial LSEs are base 2 (logits carry ``log2(e)``); stage 2 converts to natural log once, at the
output. An empty state is ``(0, -inf)``; guards test exact zeros, so a NaN in a valid input reaches
the output as it does in the reference. ``tools/static_report.py`` (``python -m tools.static_report``)
shows what each launch costs in registers and shared memory on an H200.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fold.kernels.launch import launcher

# Set when the kernels below were decorated under TRITON_INTERPRET=1 (read at decoration time).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)   # ln 2 (in kernels): base-2 LSE -> natural log


@dataclass(frozen=True)
class FoldConfig:
    """One point of the launch space."""

    block_m: int      # rows (draft row x GQA head) per program; power of two >= 16
    block_n: int      # KV entries per tile; power of two >= 16
    num_splits: int   # KV splits per sequence (fixed grid size, CUDA-graph safe)
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return dict(block_m=self.block_m, block_n=self.block_n, num_splits=self.num_splits,
                    num_warps=self.num_warps, num_stages=self.num_stages)

    @property
    def tile(self) -> tuple[int, int, int, int]:
        """The part a tuned cache stores: ``(block_m, block_n, num_warps, num_stages)``."""
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)


# The declared space the tuner sweeps. M tiles above 128 rows spill registers on every GPU we know;
# splits beyond 128 only add merge traffic (FA2/FA3 cap at 128/256 for far larger grids).
SPACE = dict(
    block_m=(16, 32, 64, 128),
    block_n=(16, 32, 64, 128),
    num_splits=(1, 2, 4, 8, 16, 32, 64, 128),
    num_warps=(2, 4, 8),
    num_stages=(1, 2, 3, 4),
)
TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
# A split reads at least this many key tiles (fewer only add merge traffic); see split_counts.
MIN_TILES_PER_SPLIT = 2
# The branch that rotates keys holds its key tile, the tile's cos/sin and the rotated tile at once:
# it reads tiles of at most this many entries (registers, see tools/static_report.py).
ROT_BLOCK_N = 32
# Stage 2 merges a row's split states this many at a time (one [MERGE_BLOCK_S, head_dim] fp32 tile).
MERGE_BLOCK_S = 16


def keep(config: FoldConfig, rows: int, head_dim: int) -> bool:
    """Prune points that cannot win: tiles taller than both the rows and 64 (the M of Hopper's
    warpgroup MMA), or huge tiles with few warps."""
    if config.block_m > max(64, triton.next_power_of_2(rows)):
        return False
    if config.block_m * config.block_n * head_dim > 128 * 64 * 128 and config.num_warps < 4:
        return False
    return True


def config_space(rows: int, head_dim: int) -> list[FoldConfig]:
    """Every kept configuration for ``rows = n_q * group`` rows of ``head_dim``."""
    points = (FoldConfig(*values) for values in itertools.product(*SPACE.values()))
    return [c for c in points if keep(c, rows, head_dim)]


def split_counts(entries: int, block_n: int) -> list[int]:
    """The split counts of the space for reading ``entries`` keys in ``block_n`` tiles: those that
    leave every split at least :data:`MIN_TILES_PER_SPLIT` tiles (and 1). The one rule for the split
    model (:func:`fold.config_lookup.num_splits_for`), the window launch, the tuner and the GPU check."""
    most = max(1, triton.cdiv(entries, block_n) // MIN_TILES_PER_SPLIT)
    return [s for s in SPACE["num_splits"] if s <= most]


@triton.jit
def _cos_sin(pos, freq):
    # cos, sin (fp32) of pos * freq for int pos and fp32 freq (broadcastable): the product is exact
    # in fp64 (|pos| < 2^29, freq has 24 bits), reduced by pi/2 in fp64, then Cephes' sinf/cosf
    # polynomials on |r| <= pi/4 and the quadrant's symmetry
    x = tl.cast(pos, tl.float64) * freq.to(tl.float64)
    k = tl.floor(x * 0.6366197723675814 + 0.5)
    r = ((x - k * 1.5707963267948966) - k * 6.123233995736766e-17).to(tl.float32)
    quadrant = k.to(tl.int32) & 3
    z = r * r
    sin_r = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    odd = (quadrant & 1) == 1
    s = tl.where(odd, cos_r, sin_r)
    c = tl.where(odd, sin_r, cos_r)
    s = tl.where(quadrant >= 2, -s, s)
    c = tl.where((quadrant == 1) | (quadrant == 2), -c, c)
    return c, s


@triton.jit
def _pair_columns(ROT_HALF: tl.constexpr, PASS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_P: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    # head-dim columns of the two halves of each pair slot c < HALF_P: rotary pairs first, then the
    # pass-through dims paired up (frequency 0); returns (col_a, col_b, m_a, m_b, is_rot) [HALF_P]
    o_c = tl.arange(0, HALF_P)
    PASS_HALF: tl.constexpr = (PASS + 1) // 2
    if INTERLEAVED:
        rot_a = 2 * o_c
        rot_b = 2 * o_c + 1
    else:
        rot_a = o_c
        rot_b = o_c + ROT_HALF
    if PASS == 0:
        col_a = rot_a
        col_b = rot_b
    else:
        o_p = o_c - ROT_HALF
        col_a = tl.where(o_c < ROT_HALF, rot_a, 2 * ROT_HALF + o_p)
        col_b = tl.where(o_c < ROT_HALF, rot_b, 2 * ROT_HALF + PASS_HALF + o_p)
    m_a = (o_c < ROT_HALF + PASS_HALF) & (col_a < HEAD_DIM)
    m_b = (o_c < ROT_HALF + PASS_HALF) & (col_b < HEAD_DIM)
    return col_a, col_b, m_a, m_b, o_c < ROT_HALF


@triton.jit
def program_rows(pid, heads_kv, rows, GROUP: tl.constexpr, M_TILES: tl.constexpr, BLOCK_M: tl.constexpr):
    # program pid of a (batch, KV head, row tile) grid -> i_b, i_kvh, its rows o_m = r * GROUP + h
    # [BM], their mask (o_m < rows), draft row o_r and query head i_hq
    i_b = (pid // (heads_kv * M_TILES)).to(tl.int64)
    i_kvh = ((pid // M_TILES) % heads_kv).to(tl.int64)
    o_m = (pid % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    return i_b, i_kvh, o_m, o_m < rows, o_m // GROUP, i_kvh * GROUP + (o_m % GROUP)


@triton.jit
def _rotate_store(p_out, qa, qb, pos, freq, col_a, col_b, m_a, m_b, m_row, m_store,
                  PAIR_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    # qa, qb: [BM, HALF_P] the pair halves; writes R_pos q as one [BM, BLOCK_D] row block
    HALF_P: tl.constexpr = BLOCK_D // 2
    c, s = _cos_sin(pos, freq)
    ra = qa * c - qb * s
    rb = qb * c + qa * s
    dtype = p_out.dtype.element_ty
    o_c = tl.arange(0, HALF_P)
    if PAIR_ORDER:
        tl.store(p_out + o_c[None, :], ra.to(dtype), mask=m_store)
        tl.store(p_out + HALF_P + o_c[None, :], rb.to(dtype), mask=m_store)
    else:
        tl.store(p_out + col_a[None, :], ra.to(dtype), mask=m_row[:, None] & m_a[None, :])
        tl.store(p_out + col_b[None, :], rb.to(dtype), mask=m_row[:, None] & m_b[None, :])
        if BLOCK_D > HEAD_DIM:  # padding columns of a natural-order row
            o_d = tl.arange(0, BLOCK_D)
            tl.store(p_out + o_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], dtype),
                     mask=m_row[:, None] & (o_d >= HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=["n_q", "max_len", "window"])
def fold_fwd_kernel_prologue(
    Q, InvFreq, SeqLens, QW, QF, Trig,
    stride_qb, stride_qn, stride_qh,
    stride_wb, stride_wh, stride_wm,
    heads_kv, n_q, max_len, window, q_rot_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROT_HALF: tl.constexpr, PASS: tl.constexpr, INTERLEAVED: tl.constexpr, KEYS_ROTATED: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, M_TILES: tl.constexpr, BLOCK_M: tl.constexpr, ROT_BLOCK_N: tl.constexpr,
    FAR_PER_ROW: tl.constexpr, QUERIES_ROTATED: tl.constexpr,
):
    # QW, QF: [B, Hkv, n_q * GROUP, BLOCK_D] in the key tile's column order (natural, except for the
    # branch that rotates keys when the pairs do not tile the head dim: pair order [a | b]);
    # Trig: [2, ROT_BLOCK_N, HALF_P]
    HALF_P: tl.constexpr = BLOCK_D // 2
    EVEN_PAIRS: tl.constexpr = (PASS == 0) & (2 * ROT_HALF == BLOCK_D)
    i_bhm = tl.program_id(0)
    i_b, i_kvh, o_m, m_row, o_r, i_hq = program_rows(i_bhm, heads_kv, n_q * GROUP, GROUP, M_TILES, BLOCK_M)
    col_a, col_b, m_a, m_b, is_rot = _pair_columns(ROT_HALF, PASS, HEAD_DIM, HALF_P, INTERLEAVED)
    freq = tl.load(InvFreq + tl.arange(0, HALF_P), mask=is_rot, other=0.0)         # [HALF_P], 0 for pass-through
    o_c = tl.arange(0, HALF_P)

    if i_bhm == 0:  # cos/sin of i * f for the offsets i of a key tile
        cos_i, sin_i = _cos_sin(tl.arange(0, ROT_BLOCK_N)[:, None], freq[None, :])   # [ROT_BLOCK_N, HALF_P]
        p_t = Trig + tl.arange(0, ROT_BLOCK_N)[:, None] * HALF_P + o_c[None, :]
        tl.store(p_t, cos_i)
        tl.store(p_t + ROT_BLOCK_N * HALF_P, sin_i)

    if HAS_SEQLENS:
        seq_len = tl.load(SeqLens + i_b).to(tl.int32)
    else:
        seq_len = max_len
    p_q = Q + i_b * stride_qb + o_r[:, None] * stride_qn + i_hq[:, None] * stride_qh
    qa = tl.load(p_q + col_a[None, :], mask=m_row[:, None] & m_a[None, :], other=0.0).to(tl.float32)
    qb = tl.load(p_q + col_b[None, :], mask=m_row[:, None] & m_b[None, :], other=0.0).to(tl.float32)
    pair_scale = tl.where(is_rot, q_rot_scale, 1.0)[None, :]
    qa *= pair_scale
    qb *= pair_scale
    m_store = m_row[:, None] & (o_c < HALF_P)[None, :]                                # [BM, HALF_P]
    p_w = QW + i_b * stride_wb + i_kvh * stride_wh + o_m[:, None] * stride_wm
    p_f = QF + i_b * stride_wb + i_kvh * stride_wh + o_m[:, None] * stride_wm
    # window at the true positions n + r; far memory at the shared distance D + r (FOLD), or at the
    # distance D from every row (FAR_PER_ROW off: ReRoPE's rule). Queries that arrive rotated at
    # n + r are turned by the difference: 0 for the window, far position - (n + r) for the far memory.
    true_pos = seq_len - n_q + o_r
    far_pos = window + n_q + o_r if FAR_PER_ROW else window + n_q + 0 * o_r
    if QUERIES_ROTATED:
        win_pos = 0 * o_r
        far_pos = far_pos - true_pos
    else:
        win_pos = true_pos
    _rotate_store(p_w, qa, qb, win_pos[:, None], freq[None, :], col_a, col_b, m_a, m_b,
                  m_row, m_store, PAIR_ORDER=(not KEYS_ROTATED) & (not EVEN_PAIRS), BLOCK_M=BLOCK_M,
                  BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    _rotate_store(p_f, qa, qb, far_pos[:, None], freq[None, :], col_a, col_b, m_a, m_b,
                  m_row, m_store, PAIR_ORDER=KEYS_ROTATED & (not EVEN_PAIRS), BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                  HEAD_DIM=HEAD_DIM)


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap) in float32: a series near 0 (no cancellation), exp2 of -2|x| beyond (saturates,
    # never overflows); a NaN stays NaN
    x = s / cap
    a = tl.abs(x)
    x2 = x * x
    small = a * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    e = tl.exp2(-2.8853900817779268 * a)                 # exp(-2 |x|)
    t = tl.where(a < 0.125, small, (1.0 - e) / (1.0 + e))
    return cap * tl.where(x < 0.0, -t, t)


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    # m_i, l_i: [BM]; acc: [BM, BLOCK_D]; s: [BM, BN] base-2 logits, -inf where masked; v: [BN, BLOCK_D]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing seen yet stays empty
    corr = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * corr + tl.sum(p, 1)
    acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_rows(p, m_n, m_col, MASK_N: tl.constexpr, MASK_COL: tl.constexpr, UPCAST: tl.constexpr):
    # one [BN, C] tile; masks only where the tile can cross the sequence end or padded columns
    if MASK_N:
        if MASK_COL:
            x = tl.load(p, mask=m_n[:, None] & m_col[None, :], other=0.0)
        else:
            x = tl.load(p, mask=m_n[:, None], other=0.0)
    elif MASK_COL:
        x = tl.load(p, mask=m_col[None, :], other=0.0)
    else:
        x = tl.load(p)
    if UPCAST:  # the interpreter's bf16 arithmetic is broken; casts are exact
        x = x.to(tl.float32)
    return x


@triton.jit
def _row_offsets(o_n, m_n, p_table, stride_kb, stride_kn, stride_vb, stride_vn, MASKED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    # [BN] int64 offsets of the tile's K and V rows: o_n * stride, or in a paged cache (page table
    # row p_table) the page's offset plus the slot's
    if PAGE_SIZE == 0:
        o_n64 = o_n.to(tl.int64)
        return o_n64 * stride_kn, o_n64 * stride_vn
    if MASKED:
        page = tl.load(p_table + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
    else:
        page = tl.load(p_table + o_n // PAGE_SIZE).to(tl.int64)
    slot = (o_n % PAGE_SIZE).to(tl.int64)
    return page * stride_kb + slot * stride_kn, page * stride_vb + slot * stride_vn


@triton.jit
def _attend(m_i, l_i, acc, q, p_k0, p_v0, p_table, stride_kb, stride_kn, stride_vb, stride_vn, lo, hi, o_ws, span,
            InvFreq, Trig, qk_scale, softcap, post_scale, SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
            IS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, ROTATE: tl.constexpr,
            PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            ROT_HALF: tl.constexpr, PASS: tl.constexpr, INTERLEAVED: tl.constexpr, UPCAST: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    # one branch over entries [lo, hi), lo aligned to BLOCK_N; q: [BM, BLOCK_D] rotated, unscaled, in the
    # key tile's column order; logits = dot * qk_scale, or with SOFTCAP softcap * tanh(dot * qk_scale /
    # softcap) * post_scale (base 2 either way); o_ws [BM]: the row's first window entry (its own at o_ws + span - 1).
    # Unmasked (MASKED=False) only where every entry of every tile is valid and in this branch for
    # every row.
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    EVEN_PAIRS: tl.constexpr = (PASS == 0) & (2 * ROT_HALF == BLOCK_D)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    HALF_P: tl.constexpr = BLOCK_D // 2
    o_i = tl.arange(0, BLOCK_N)
    if ROTATE:
        col_a, col_b, m_a, m_b, is_rot = _pair_columns(ROT_HALF, PASS, HEAD_DIM, HALF_P, INTERLEAVED)
        freq = tl.load(InvFreq + tl.arange(0, HALF_P), mask=is_rot, other=0.0)      # [HALF_P], 0 for pass-through
        o_c = tl.arange(0, HALF_P)
        p_trig = Trig + o_i[:, None] * HALF_P + o_c[None, :]
    for t0 in range(lo, hi, BLOCK_N):
        o_n = t0 + o_i
        m_n = o_n < hi
        r_k, r_v = _row_offsets(o_n, m_n, p_table, stride_kb, stride_kn, stride_vb, stride_vn, MASKED, PAGE_SIZE)
        p_v = p_v0 + r_v[:, None] + o_d[None, :]
        if ROTATE:
            p_k = p_k0 + r_k[:, None]
            if EVEN_PAIRS:  # one [BN, BLOCK_D] load, split into the pair halves in registers
                k = _load_rows(p_k + o_d[None, :], m_n, m_d, MASKED, False, UPCAST)
                if INTERLEAVED:
                    ka, kb = tl.split(tl.reshape(k, (BLOCK_N, HALF_P, 2)))
                else:
                    ka, kb = tl.split(tl.permute(tl.reshape(k, (BLOCK_N, 2, HALF_P)), (0, 2, 1)))
            else:           # partial rotary or padded dims: the halves by column maps
                ka = _load_rows(p_k + col_a[None, :], m_n, m_a, MASKED, True, UPCAST)
                kb = _load_rows(p_k + col_b[None, :], m_n, m_b, MASKED, True, UPCAST)
            ka = ka.to(tl.float32)
            kb = kb.to(tl.float32)
            # cos/sin((t0 + i) f) from cos/sin(t0 f) [HALF_P] and the table of cos/sin(i f) [BN, HALF_P]
            cos_t, sin_t = _cos_sin(t0, freq)
            cos_i = tl.load(p_trig, mask=m_n[:, None], other=0.0)   # masked by rows, so it stays in the loop
            sin_i = tl.load(p_trig + BLOCK_N * HALF_P, mask=m_n[:, None], other=0.0)
            c = cos_t[None, :] * cos_i - sin_t[None, :] * sin_i
            s = sin_t[None, :] * cos_i + cos_t[None, :] * sin_i
            if not IS_WINDOW:                   # the far branch un-rotates: R_{-j}
                s = -s
            ra = ka * c - kb * s
            rb = kb * c + ka * s
            if EVEN_PAIRS and INTERLEAVED:      # back to the natural order
                k = tl.reshape(tl.join(ra, rb), (BLOCK_N, BLOCK_D))
            else:                               # natural order (NeoX), or the pair order [a | b]
                k = tl.reshape(tl.permute(tl.join(ra, rb), (0, 2, 1)), (BLOCK_N, BLOCK_D))
            k = k.to(q.dtype)
        else:   # in the query tile's dtype: an FP8 cache is dequantized on load (its scale is in q's)
            k = _load_rows(p_k0 + r_k[:, None] + o_d[None, :], m_n, m_d, MASKED, not EVEN_D, UPCAST).to(q.dtype)
        v = _load_rows(p_v, m_n, m_d, MASKED, not EVEN_D, UPCAST).to(q.dtype)
        # [BM, BLOCK_D] @ [BLOCK_D, BN] -> [BM, BN], scaled in float32 after the dot: base-2 logits
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap) * post_scale
        if MASKED:
            if IS_WINDOW:
                m_s = m_n[None, :] & (o_n[None, :] >= o_ws[:, None])
                if CAUSAL:                      # row r sees the block up to its own entry: j <= ws_r + span - 1
                    m_s = m_s & (o_n[None, :] < (o_ws + span)[:, None])
            else:
                m_s = m_n[None, :] & (o_n[None, :] < o_ws[:, None])
            s = tl.where(m_s, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _store_state(p_o, p_lse, m_i, l_i, acc, m_store, m_row):
    # a row that saw nothing (l = 0) is (0, -inf); a NaN (from a NaN input) stays NaN in o and lse
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(p_o, o, mask=m_store)
    tl.store(p_lse, tl.where(empty, float("-inf"), m_i + tl.log2(l_i)), mask=m_row)


@triton.jit(do_not_specialize=["n_q", "max_len", "span", "num_splits", "state_offset", "num_slots"])
def fold_fwd_kernel_stage1(
    Q, K, V, InvFreq, Trig, SeqLens, BlockTable, FarPages, OPart, LsePart,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_tb, stride_fb, stride_fh,
    stride_ob, stride_oh, stride_or, stride_os,
    stride_lb, stride_lh, stride_lr,
    heads_kv, n_q, max_len, span, num_splits, state_offset, num_slots, qk_scale, softcap, post_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROT_HALF: tl.constexpr, PASS: tl.constexpr, INTERLEAVED: tl.constexpr, IS_WINDOW: tl.constexpr,
    CAUSAL: tl.constexpr, ROTATE: tl.constexpr, PLAIN: tl.constexpr, HAS_SEQLENS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    FAR_PAGE: tl.constexpr, M_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # one branch (IS_WINDOW or the far memory) over its entries of one sequence, split in num_splits
    # shares of BLOCK_N tiles; writes state state_offset + i_split of each row. Row r's local branch is
    # p - j < span (W + n_q, or a sliding layer's window), CAUSAL hides j > p. Q is the prologue's
    # [B, Hkv, rows, BLOCK_D] (stride_qm per row m); with PLAIN, a plain read: every row reads every
    # entry [0, L), Q is the caller's [B, n_q, Hq, d] (stride_qm per draft row). The logits are the
    # dots times qk_scale (and soft-capped with SOFTCAP, see _attend). With PAGE_SIZE > 0, K and V are pages [num_blocks, PAGE_SIZE, Hkv, d] and BlockTable
    # [B, max_blocks] maps a sequence's entry j to page BlockTable[b, j // PAGE_SIZE], slot j % PAGE_SIZE.
    # With FAR_PAGE > 0 (far launch only), a budgeted far read: FarPages [B, Hkv, num_slots] lists the
    # pages (entries [t FAR_PAGE, (t + 1) FAR_PAGE), -1 for none) of this KV head; the splits share the
    # slots, and each page is read in masked BLOCK_N tiles (each row its own far entries).
    i_bhm = tl.program_id(0)
    i_split = tl.program_id(1)
    i_b, i_kvh, o_m, m_row, o_r, i_hq = program_rows(i_bhm, heads_kv, n_q * GROUP, GROUP, M_TILES, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM

    if HAS_SEQLENS:
        seq_len = tl.load(SeqLens + i_b).to(tl.int32)
    else:
        seq_len = max_len
    n_ctx = seq_len - n_q
    if PLAIN:                               # [0, L) for every row: far memory whose window starts at L
        win_lo = seq_len
        o_ws = seq_len + 0 * o_r
        lo = 0
        hi = seq_len
    else:
        win_lo = n_ctx - span + 1           # row r's window starts at win_lo + r
        o_ws = win_lo + o_r                 # [BM]
        if IS_WINDOW:                       # window: [win_lo, L), from a BLOCK_N-aligned start
            lo = tl.maximum(win_lo, 0) // BLOCK_N * BLOCK_N
            hi = seq_len
        else:                               # far memory: entries < win_lo + n_q - 1 are far for some row
            lo = 0
            hi = tl.maximum(win_lo + n_q - 1, 0)
    if FAR_PAGE > 0:                        # this split's share of the page slots
        start = i_split * num_slots // num_splits
        end = (i_split + 1) * num_slots // num_splits
    else:                                   # this split's share of the branch's tiles: balanced to one tile
        n_tiles = tl.cdiv(hi - lo, BLOCK_N)
        start = lo + (i_split * n_tiles // num_splits) * BLOCK_N
        end = tl.minimum(lo + ((i_split + 1) * n_tiles // num_splits) * BLOCK_N, hi)

    i_state = state_offset + i_split
    p_l = LsePart + i_b * stride_lb + i_hq * stride_lh + o_r * stride_lr + i_state
    if end > start:
        if PLAIN:
            q = tl.load(Q + i_b * stride_qb + o_r[:, None] * stride_qm + i_hq[:, None] * stride_qh + o_d[None, :],
                        mask=m_row[:, None] & m_d[None, :], other=0.0)
            q = q.to(tl.float32 if UPCAST else K.dtype.element_ty)
        else:
            q = tl.load(Q + i_b * stride_qb + i_kvh * stride_qh + o_m[:, None] * stride_qm + o_d[None, :],
                        mask=m_row[:, None], other=0.0)
        if PAGE_SIZE == 0:
            p_k0 = K + i_b * stride_kb + i_kvh * stride_kh
            p_v0 = V + i_b * stride_vb + i_kvh * stride_vh
        else:                               # the page table gives each row's page
            p_k0 = K + i_kvh * stride_kh
            p_v0 = V + i_kvh * stride_vh
        p_table = BlockTable + i_b * stride_tb
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if FAR_PAGE > 0:                    # the listed pages, each masked to the rows' far entries below hi
            p_pages = FarPages + i_b * stride_fb + i_kvh * stride_fh
            for i_slot in range(start, end):
                page = tl.load(p_pages + i_slot)
                page_lo = page * FAR_PAGE
                page_hi = tl.where(page >= 0, tl.minimum(page_lo + FAR_PAGE, hi), page_lo)
                m_i, l_i, acc = _attend(m_i, l_i, acc, q, p_k0, p_v0, p_table, stride_kb, stride_kn, stride_vb,
                                        stride_vn, page_lo, page_hi, o_ws, span, InvFreq, Trig, qk_scale, softcap,
                                        post_scale, SOFTCAP, True, IS_WINDOW,
                                        CAUSAL, ROTATE, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, ROT_HALF, PASS,
                                        INTERLEAVED, UPCAST, DOT_PRECISION)
        else:
            # the far memory is unmasked up to the last whole tile below win_lo; the window is masked throughout
            if IS_WINDOW:
                mid = start
            else:
                mid = start + tl.maximum(tl.minimum(end, win_lo) - start, 0) // BLOCK_N * BLOCK_N
            for masked in tl.static_range(2):   # [start, mid) unmasked, then [mid, end) masked
                if masked or not IS_WINDOW:
                    m_i, l_i, acc = _attend(m_i, l_i, acc, q, p_k0, p_v0, p_table, stride_kb, stride_kn, stride_vb,
                                            stride_vn, mid if masked else start, end if masked else mid, o_ws, span,
                                            InvFreq, Trig, qk_scale, softcap, post_scale, SOFTCAP, masked,
                                            IS_WINDOW, CAUSAL, ROTATE, PAGE_SIZE, BLOCK_N,
                                            HEAD_DIM, BLOCK_D,
                                            ROT_HALF, PASS, INTERLEAVED, UPCAST, DOT_PRECISION)
        p_o = (OPart + i_b * stride_ob + i_hq[:, None] * stride_oh + o_r[:, None] * stride_or + i_state * stride_os
               + o_d[None, :])
        _store_state(p_o, p_l, m_i, l_i, acc, m_row[:, None] & m_d[None, :], m_row)
    else:                                   # an empty state: its o is never read
        tl.store(p_l, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_row)


@triton.jit
def _branch_mass(m, z, lse, in_branch):
    # online log2-sum-exp2 over one branch's states, a [BLOCK_S] tile at a time: running max m and
    # sum z relative to it; an empty branch stays (-inf, 0)
    x = tl.where(in_branch, lse, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    z = z * tl.exp2(m - m_safe) + tl.sum(tl.exp2(x - m_safe), 0)
    return m_new, z


@triton.jit(do_not_specialize=["n_q", "far_states", "num_states", "v_scale"])
def fold_fwd_kernel_stage2(
    OPart, LsePart, Out, Lse,
    stride_ob, stride_oh, stride_or, stride_os,
    stride_lb, stride_lh, stride_lr,
    stride_outb, stride_outn, stride_outh,
    stride_lseb, stride_lsen,
    heads_q, n_q, far_states, num_states, inv_alpha, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, RETURN_LSE: tl.constexpr, LSE_BASE2: tl.constexpr,
):
    # one row: its states [far splits | window splits], BLOCK_S at a time (a [BLOCK_S, BLOCK_D] tile
    # of o per step, whatever the split count); two passes: each branch's mass from the LSEs, then
    # the weighted sum of the states' o, times v_scale (an FP8 cache holds v / v_scale)
    pid = tl.program_id(0)
    i_b = (pid // (heads_q * n_q)).to(tl.int64)
    i_hq = ((pid // n_q) % heads_q).to(tl.int64)
    i_r = (pid % n_q).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_l = LsePart + i_b * stride_lb + i_hq * stride_lh + i_r * stride_lr
    p_o = OPart + i_b * stride_ob + i_hq * stride_oh + i_r * stride_or + o_d[None, :]

    # per branch: log2 of its mass (the far one in alpha-space, then / alpha)
    m_w = tl.full([], float("-inf"), tl.float32)
    m_f = tl.full([], float("-inf"), tl.float32)
    z_w = tl.zeros([], tl.float32)
    z_f = tl.zeros([], tl.float32)
    for s0 in range(0, num_states, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(p_l + o_s, mask=o_s < num_states, other=float("-inf"))      # [BLOCK_S] base 2
        m_w, z_w = _branch_mass(m_w, z_w, lse, o_s >= far_states)
        m_f, z_f = _branch_mass(m_f, z_f, lse, o_s < far_states)
    m_w = tl.where(m_w == float("-inf"), 0.0, m_w)
    m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
    # guards test for exact zeros (empty), never "> 0", so that a NaN state makes the row NaN
    lse_w = m_w + tl.log2(z_w)                                          # -inf if the branch is empty
    lse_f = (m_f + tl.log2(z_f)) * inv_alpha
    m = tl.maximum(lse_w, lse_f)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_w = tl.exp2(lse_w - m_safe)                                       # the branches' masses, relative
    w_f = tl.exp2(lse_f - m_safe)
    total = w_w + w_f
    # a state's weight in the output: its branch's mass x its share of that branch
    norm = tl.where(total == 0.0, 1.0, total) / v_scale
    scale_w = w_w / tl.where(z_w == 0.0, 1.0, z_w) / norm              # x e = the state's weight
    scale_f = w_f / tl.where(z_f == 0.0, 1.0, z_f) / norm
    out = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_states, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < num_states
        is_far = o_s < far_states
        lse = tl.load(p_l + o_s, mask=m_s, other=float("-inf"))
        e = tl.exp2(lse - tl.where(is_far, m_f, m_w))                   # 0 for empty states
        w = e * tl.where(is_far, scale_f, scale_w)
        o = tl.load(p_o + o_s[:, None] * stride_os, mask=(m_s & (e != 0.0))[:, None] & m_d[None, :],
                    other=0.0)                                          # [BLOCK_S, BLOCK_D]
        out += tl.sum(w[:, None] * o, 0)
    tl.store(Out + i_b * stride_outb + i_r * stride_outn + i_hq * stride_outh + o_d,
             out.to(Out.dtype.element_ty), mask=m_d)
    if RETURN_LSE:
        lse2 = m_safe + tl.log2(total)
        if LSE_BASE2:   # for another of fold's kernels (the tree's), which merges in base 2
            tl.store(Lse + i_b * stride_lseb + i_r * stride_lsen + i_hq, lse2)
        else:           # the public boundary: base 2 -> e, once
            tl.store(Lse + i_b * stride_lseb + i_r * stride_lsen + i_hq, lse2 * LN2)


def window_splits(num_splits: int, max_len: int, span: int, n_q: int, block_n: int) -> int:
    """Splits of the window launch (a row's local branch ``p - j < span``): as many as the far
    memory's (it runs alone, so it should fill the GPU as that does), within :func:`split_counts` of
    its entries."""
    entries = min(max_len, span + n_q - 1 + block_n)         # the window and its alignment to a tile
    return max(s for s in split_counts(entries, block_n) if s <= max(1, num_splits))


def cache_len(k, block_table=None) -> int:
    """Entries a sequence can hold: ``k [B, max_len, Hkv, d]``, or with ``block_table [B, max_blocks]``
    pages ``[num_blocks, page_size, Hkv, d]``, whose reach is ``max_blocks * page_size``."""
    return k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]


def fold_attention_fwd(q, k, v, inv_freq, cache_seqlens, *, window, alpha, softmax_scale, rotary_dim,
                       interleaved, attention_factor, keys_rotated, return_lse, config: FoldConfig, out_dtype=None,
                       block_table=None, far_per_row=True, lse_base2=False, queries_rotated=False, read_far=True,
                       sliding_window=None, causal=False, k_scale=1.0, v_scale=1.0, far_pages=None, far_page=0,
                       softcap=0.0):
    """Launch the prologue, stage 1 (window, then far memory unless no sequence can have any) and
    stage 2. Assumes validated inputs (see ``fold.attention``); returns ``(out, lse or None)``.

    q [B, n_q, Hq, d]; k, v [B, max_len, Hkv, d] with unit stride in d, or with ``block_table``
    [B, max_blocks] int32 pages [num_blocks, page_size, Hkv, d] (``max_len = max_blocks * page_size``;
    cache_seqlens required); inv_freq [rotary_dim/2] fp32 on q's device; cache_seqlens [B] int or
    None; ``out_dtype`` defaults to q's (float32 keeps a state for merging). ``config.num_splits``
    splits the far memory; the window gets :func:`window_splits`. ``far_per_row=False`` reads the far
    memory at distance D from every row (ReRoPE) instead of D + r; ``lse_base2`` returns the LSE in
    base 2 (for the tree launcher, which merges in base 2), not the public natural log;
    ``queries_rotated``: q holds ``R_{n+r} q`` (the prologue turns each branch's copy by the difference).
    ``read_far=False`` leaves the far launch out (the local branch alone); ``sliding_window`` ``Ws``
    makes a row's local branch ``p - j < Ws`` (default ``p - j < D``); ``causal`` hides ``j > p``.
    ``k, v`` may be FP8 (read as ``k * k_scale``, ``v * v_scale``: ``k_scale`` joins the logit scale,
    ``v_scale`` the output; the query tiles stay in q's dtype). ``far_pages [B, Hkv, K]`` int32 (ascending,
    -1 padded; :func:`fold.far_pages.select_pages`): the far launch reads only those pages of ``far_page``
    entries, its splits sharing the K slots, in tiles of at most the page (>= 16 entries for the dot).
    ``softcap > 0`` caps each logit ``x = q.k * softmax_scale`` to ``softcap * tanh(x / softcap)`` before
    the far branch's ``alpha`` (the cap belongs to the drafter's logit; alpha sharpens what it gives).
    """
    batch, n_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    max_len = cache_len(k, block_table)
    group = heads_q // heads_kv
    rows = n_q * group
    m_tiles = triton.cdiv(rows, config.block_m)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    # the branch that rotates keys reads at most ROT_BLOCK_N entries per tile
    block_n_far = min(config.block_n, ROT_BLOCK_N) if keys_rotated else config.block_n
    block_n_win = config.block_n if keys_rotated else min(config.block_n, ROT_BLOCK_N)
    span = window + n_q if sliding_window is None else sliding_window        # row r's local: p - j < span
    far_splits = config.num_splits if read_far and max_len > span else 0
    if far_pages is not None and far_splits:
        slots = far_pages.shape[-1]
        block_n_far = min(block_n_far, max(16, triton.next_power_of_2(far_page)))
        tiles = slots * triton.cdiv(far_page, block_n_far)
        far_splits = max(s for s in split_counts(tiles * block_n_far, block_n_far) if s <= min(slots, far_splits))
    win_splits = window_splits(config.num_splits, max_len, span, n_q, block_n_win)
    # the rotary factor f scales q and k alike: q carries f for itself (unless it arrives rotated) and,
    # with unrotated keys, for the key too (a rotated cache holds it; un-rotating is a pure rotation)
    q_rot_scale = (1.0 if queries_rotated else attention_factor) * (1.0 if keys_rotated else attention_factor)
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, ROT_HALF=rotary_dim // 2,
                  PASS=head_dim - rotary_dim, INTERLEAVED=interleaved, HAS_SEQLENS=cache_seqlens is not None,
                  M_TILES=m_tiles, BLOCK_M=config.block_m)
    rot_block_n = block_n_win if not keys_rotated else block_n_far

    # the query tiles in the cache's dtype (the dot's), or q's for an FP8 cache, float32 for the upcast path
    tile_dtype = torch.float32 if upcast else (q.dtype if k.element_size() == 1 else k.dtype)
    qw = torch.empty(batch, heads_kv, rows, block_d, device=q.device, dtype=tile_dtype)
    qf = torch.empty_like(qw)
    trig = torch.empty(2, rot_block_n, block_d // 2, device=q.device, dtype=torch.float32)
    o_part, lse_part = _partial_states(q, far_splits + win_splits)
    seqlens = cache_seqlens if cache_seqlens is not None else q  # dummy pointers when unused
    launcher(fold_fwd_kernel_prologue, (batch * heads_kv * m_tiles,))(
        q, inv_freq, seqlens, qw, qf, trig,
        q.stride(0), q.stride(1), q.stride(2),
        qw.stride(0), qw.stride(1), qw.stride(2),
        heads_kv, n_q, max_len, window, q_rot_scale,
        **consts, KEYS_ROTATED=keys_rotated, ROT_BLOCK_N=rot_block_n, FAR_PER_ROW=far_per_row,
        QUERIES_ROTATED=queries_rotated, num_warps=4 if config.block_m <= 64 else 8,
    )
    for is_window, q_branch, splits, offset, block_n in (
            (True, qw, win_splits, far_splits, block_n_win), (False, qf, far_splits, 0, block_n_far)):
        if splits:
            _stage1(q_branch, (q_branch.stride(0), q_branch.stride(1), q_branch.stride(2)), k, v, inv_freq, trig,
                    cache_seqlens, block_table, o_part, lse_part, config, span=span, splits=splits,
                    state_offset=offset, far_pages=None if is_window else far_pages,
                    scales=logit_scales(softmax_scale * k_scale, 1.0 if is_window else alpha, softcap),
                    consts=dict(consts, IS_WINDOW=is_window, CAUSAL=causal and is_window,
                                ROTATE=is_window != keys_rotated, BLOCK_N=block_n,
                                FAR_PAGE=0 if is_window or far_pages is None else far_page))
    return _stage2(o_part, lse_part, q, far_splits, 1.0 / alpha, out_dtype=out_dtype, return_lse=return_lse,
                   lse_base2=lse_base2, v_scale=v_scale)


def plain_attention_fwd(q, k, v, cache_seqlens, *, softmax_scale, config: FoldConfig, out_dtype=None,
                        block_table=None, return_lse=True, lse_base2=False):
    """A plain read: every row of ``q`` attends to every valid cache entry, queries and keys as
    given (no RoPE, no prologue), stage 1 split in ``config.num_splits`` and stage 2. Shapes and
    options as in :func:`fold_attention_fwd`; returns ``(out, lse or None)``."""
    batch, n_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    group = heads_q // heads_kv
    m_tiles = triton.cdiv(n_q * group, config.block_m)
    o_part, lse_part = _partial_states(q, config.num_splits)
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), ROT_HALF=0,
                  PASS=head_dim, INTERLEAVED=False, HAS_SEQLENS=cache_seqlens is not None, M_TILES=m_tiles,
                  BLOCK_M=config.block_m, IS_WINDOW=False, CAUSAL=False, ROTATE=False, BLOCK_N=config.block_n)
    # q read in place: rows r * GROUP + h at (b, r, kvh * GROUP + h), so the row stride is the draft row's
    _stage1(q, (q.stride(0), q.stride(2), q.stride(1)), k, v, lse_part, lse_part, cache_seqlens, block_table,
            o_part, lse_part, config, span=0, splits=config.num_splits, state_offset=0,
            scales=logit_scales(softmax_scale, 1.0, 0.0), consts=dict(consts, PLAIN=True))
    return _stage2(o_part, lse_part, q, 0, 1.0, out_dtype=out_dtype, return_lse=return_lse, lse_base2=lse_base2)


def _partial_states(q, states: int):
    """Stage 1's outputs for ``states`` states per row: o [B, Hq, n_q, states, d], lse [B, Hq, n_q, >= states]."""
    batch, n_q, heads_q, head_dim = q.shape
    o_part = torch.empty(batch, heads_q, n_q, states, head_dim, device=q.device, dtype=torch.float32)
    # rows of 16-multiple length: its strides (kernel arguments) keep one alignment class for any split count
    lse_part = torch.empty(batch, heads_q, n_q, triton.cdiv(states, 16) * 16, device=q.device, dtype=torch.float32)
    return o_part, lse_part


def logit_scales(scale: float, alpha: float, softcap: float) -> tuple[float, float, float]:
    """Stage 1's ``(qk_scale, softcap, post_scale)`` for logits ``alpha * cap(q.k * scale)`` in base 2:
    one product after the dot without a cap (``scale * alpha * log2 e``), else the scale, the cap and
    ``alpha * log2 e`` after it. Products of host floats: no rounded product of them reaches a tile."""
    if softcap:
        return scale, softcap, alpha * LOG2E
    return scale * alpha * LOG2E, 0.0, 1.0


def _stage1(q, q_strides, k, v, inv_freq, trig, cache_seqlens, block_table, o_part, lse_part, config: FoldConfig, *,
            span, splits, state_offset, scales, consts, far_pages=None):
    """One stage-1 launch of ``splits`` splits writing states ``state_offset + i``; ``consts`` hold
    its constexprs but PAGE_SIZE, PLAIN and FAR_PAGE (default off), UPCAST, DOT_PRECISION and SOFTCAP;
    ``scales``: :func:`logit_scales`; ``far_pages [B, Hkv, K]`` with ``FAR_PAGE``."""
    batch, n_q, heads_kv = o_part.shape[0], o_part.shape[2], k.shape[2]
    upcast = INTERPRETED and k.dtype == torch.bfloat16
    seqlens = cache_seqlens if cache_seqlens is not None else o_part   # dummy pointers when unused
    table = block_table if block_table is not None else lse_part
    pages = far_pages if far_pages is not None else lse_part          # a dummy pointer when unused
    launcher(fold_fwd_kernel_stage1, (batch * heads_kv * consts["M_TILES"], splits))(
        q, k, v, inv_freq, trig, seqlens, table, pages, o_part, lse_part,
        *q_strides,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        table.stride(0), pages.stride(0), pages.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        heads_kv, n_q, cache_len(k, block_table), span, splits, state_offset,
        pages.shape[-1] if far_pages is not None else 0, *scales,
        **{"PLAIN": False, "FAR_PAGE": 0, **consts}, PAGE_SIZE=k.shape[1] if block_table is not None else 0,
        UPCAST=upcast, SOFTCAP=scales[1] > 0.0,
        DOT_PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _stage2(o_part, lse_part, q, far_states: int, inv_alpha: float, *, out_dtype, return_lse, lse_base2,
            v_scale=1.0):
    """Merge each row's states (the first ``far_states`` in alpha-space) into ``(out, lse or None)``."""
    batch, n_q, heads_q, head_dim = q.shape
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty(batch, n_q, heads_q, device=q.device, dtype=torch.float32) if return_lse else out
    launcher(fold_fwd_kernel_stage2, (batch * heads_q * n_q,))(
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        heads_q, n_q, far_states, o_part.shape[3], inv_alpha, v_scale,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_S=MERGE_BLOCK_S, RETURN_LSE=return_lse, LSE_BASE2=lse_base2,
        num_warps=4 if head_dim >= 128 else 2,
    )
    return out, (lse if return_lse else None)
