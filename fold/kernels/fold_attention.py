"""Fused FOLD attention in Triton: configs -> jit kernels -> launcher.

Stage 1 is one launch over ``(batch * heads_kv * m_tiles, num_splits)`` programs. A program owns
``BLOCK_M`` rows (draft row x GQA head, packed so each KV tile is loaded once per KV head) and one
contiguous split of the KV axis, and writes two partial states per row: the window's and the far
memory's. Stage 2 merges the window splits as they are, the far splits in alpha-space (their LSE is
``LSE(alpha * logits)``), divides the far LSE by alpha and merges the two branches.

Per sequence (``L`` entries, ``n = L - n_q``, ``D = W + n_q``, ``win_lo = n - D + 1``) row ``r``
reads ``j < win_lo + r`` as far memory and ``j >= win_lo + r`` as window. A split runs one loop per
branch over the part of its range that branch can touch (far: ``j < n - W``; window:
``j >= win_lo``), so only ``n_q - 1`` entries are read twice and one accumulator is live at a time.

Rotations happen in registers from ``position * inv_freq`` in fp32. With unrotated keys the window
rotates q and k relative to the block's start ``n`` (only differences of positions matter, and the
small angles stay exact in fp32 at any context length) and the far branch reads keys as they are; with rotated keys
the window reads keys as they are and the far branch rotates them back by ``-j``.

Partial LSEs are base 2 (logits carry ``log2(e)``); stage 2 converts to natural log once, at the
output. An empty split or branch is the state ``(0, -inf)``; stage 2 never loads the ``o`` of a
state whose weight is zero.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Set when the kernels below were decorated under TRITON_INTERPRET=1 (read at decoration time).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634


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


# The declared space the tuner sweeps. M tiles above 128 rows spill registers on every GPU we know;
# splits beyond 128 only add merge traffic (FA2/FA3 cap at 128/256 for far larger grids).
SPACE = dict(
    block_m=(16, 32, 64, 128),
    block_n=(16, 32, 64, 128),
    num_splits=(1, 2, 4, 8, 16, 32, 64, 128),
    num_warps=(2, 4, 8),
    num_stages=(1, 2, 3, 4),
)


def keep(config: FoldConfig, rows: int, head_dim: int) -> bool:
    """Prune points that cannot win: tiles much taller than the rows, or huge tiles with few warps."""
    if config.block_m > max(16, triton.next_power_of_2(rows)):
        return False
    if config.block_m * config.block_n * head_dim > 128 * 64 * 128 and config.num_warps < 4:
        return False
    return True


def config_space(rows: int, head_dim: int) -> list[FoldConfig]:
    """Every kept configuration for ``rows = n_q * group`` rows of ``head_dim``."""
    points = (FoldConfig(*values) for values in itertools.product(*SPACE.values()))
    return [c for c in points if keep(c, rows, head_dim)]


@triton.jit
def _rotate(xa, xb, pos, inv_freq):
    # xa, xb: [R, HALF_P] the two halves of each rotary pair; pos: [R] fp32; inv_freq: [HALF_P]
    angle = pos[:, None] * inv_freq[None, :]
    c = tl.cos(angle)
    s = tl.sin(angle)
    return xa * c - xb * s, xb * c + xa * s


@triton.jit
def _logits(qa, qb, qp, ka, kb, kp, HAS_PASS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # [BM, HALF_P] @ [HALF_P, BN] (+ the pass-through dims) -> [BM, BN]
    s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PRECISION)
    s += tl.dot(qb, tl.trans(kb), input_precision=DOT_PRECISION)
    if HAS_PASS:
        s += tl.dot(qp, tl.trans(kp), input_precision=DOT_PRECISION)
    return s


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
def _store_state(p_o, p_lse, m_i, l_i, acc, m_store, m_row):
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(p_o, o, mask=m_store)
    tl.store(p_lse, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=m_row)


@triton.jit
def _load_kv(p_k0, p_v0, stride_kn, stride_vn, o_n, m_n, d_a, d_b, d_p, m_half, m_pass, o_d, m_d,
             UPCAST: tl.constexpr):
    # one KV tile: the two rotary halves [BN, HALF_P], the pass-through dims [BN, PASS_P], v [BN, BLOCK_D]
    p_k = p_k0 + o_n[:, None].to(tl.int64) * stride_kn
    ka = tl.load(p_k + d_a[None, :], mask=m_n[:, None] & m_half[None, :], other=0.0)
    kb = tl.load(p_k + d_b[None, :], mask=m_n[:, None] & m_half[None, :], other=0.0)
    kp = tl.load(p_k + d_p[None, :], mask=m_n[:, None] & m_pass[None, :], other=0.0)
    v = tl.load(p_v0 + o_n[:, None].to(tl.int64) * stride_vn + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 arithmetic is broken; casts are exact
        ka = ka.to(tl.float32)
        kb = kb.to(tl.float32)
        kp = kp.to(tl.float32)
        v = v.to(tl.float32)
    return ka, kb, kp, v


@triton.jit(do_not_specialize=["max_len", "window", "num_splits"])
def fold_fwd_kernel_stage1(
    Q, K, V, InvFreq, SeqLens, OPart, LsePart,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_oh, stride_or, stride_obr, stride_os,
    stride_lb, stride_lh, stride_lr, stride_lbr,
    heads_kv, max_len, window, num_splits, q_rot_scale, scale_window, scale_far,
    N_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROT_HALF: tl.constexpr, HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
    INTERLEAVED: tl.constexpr, KEYS_ROTATED: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    M_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    HAS_PASS: tl.constexpr = PASS > 0
    i_bhm = tl.program_id(0)
    i_split = tl.program_id(1)
    i_b = (i_bhm // (heads_kv * M_TILES)).to(tl.int64)
    i_kvh = ((i_bhm // M_TILES) % heads_kv).to(tl.int64)
    i_mt = i_bhm % M_TILES

    # rows of this program: m = r * GROUP + h
    o_m = i_mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_row = o_m < N_Q * GROUP
    o_r = o_m // GROUP
    i_hq = i_kvh * GROUP + (o_m % GROUP)

    # head-dim offsets: the two halves of each rotary pair, the pass-through dims, the full row
    o_half = tl.arange(0, HALF_P)
    m_half = o_half < ROT_HALF
    if INTERLEAVED:
        d_a = 2 * o_half
        d_b = 2 * o_half + 1
    else:
        d_a = o_half
        d_b = o_half + ROT_HALF
    d_p = 2 * ROT_HALF + tl.arange(0, PASS_P)
    m_pass = tl.arange(0, PASS_P) < PASS
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    inv_freq = tl.load(InvFreq + o_half, mask=m_half, other=0.0)

    if HAS_SEQLENS:
        seq_len = tl.load(SeqLens + i_b).to(tl.int32)
    else:
        seq_len = max_len
    n_ctx = seq_len - N_Q
    d_pos = window + N_Q
    win_lo = n_ctx - d_pos + 1              # row r's window starts at win_lo + r
    far_hi = n_ctx - window                 # entries < far_hi are far for at least one row
    o_ws = win_lo + o_r                     # [BM]

    # queries: rotate in fp32, fold scale * log2(e) (and alpha for the far branch) into them
    p_q = Q + i_b * stride_qb + o_r[:, None] * stride_qn + i_hq[:, None] * stride_qh
    m_qh = m_row[:, None] & m_half[None, :]
    qa = tl.load(p_q + d_a[None, :], mask=m_qh, other=0.0).to(tl.float32)
    qb = tl.load(p_q + d_b[None, :], mask=m_qh, other=0.0).to(tl.float32)
    qp = tl.load(p_q + d_p[None, :], mask=m_row[:, None] & m_pass[None, :], other=0.0).to(tl.float32)
    if KEYS_ROTATED:
        pos_qw = (n_ctx + o_r).to(tl.float32)
    else:
        pos_qw = o_r.to(tl.float32)
    qwa, qwb = _rotate(qa, qb, pos_qw, inv_freq)
    qfa, qfb = _rotate(qa, qb, (d_pos + o_r).to(tl.float32), inv_freq)
    qwa *= q_rot_scale * scale_window
    qwb *= q_rot_scale * scale_window
    qfa *= q_rot_scale * scale_far
    qfb *= q_rot_scale * scale_far
    qwp = qp * scale_window
    qfp = qp * scale_far
    if not UPCAST:
        qwa = qwa.to(K.dtype.element_ty)
        qwb = qwb.to(K.dtype.element_ty)
        qwp = qwp.to(K.dtype.element_ty)
        qfa = qfa.to(K.dtype.element_ty)
        qfb = qfb.to(K.dtype.element_ty)
        qfp = qfp.to(K.dtype.element_ty)

    # this split's KV range, in BLOCK_N-aligned chunks
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = i_split * chunk
    end = tl.minimum(start + chunk, seq_len)
    p_k0 = K + i_b * stride_kb + i_kvh * stride_kh
    p_v0 = V + i_b * stride_vb + i_kvh * stride_vh
    p_o = (OPart + i_b * stride_ob + i_hq[:, None] * stride_oh + o_r[:, None] * stride_or
           + i_split * stride_os + o_d[None, :])
    p_l = LsePart + i_b * stride_lb + i_hq * stride_lh + o_r * stride_lr + i_split
    m_store = m_row[:, None] & m_d[None, :]

    # far memory: j < win_lo + r, read at the shared position (one state live at a time)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    far_end = tl.minimum(end, tl.maximum(far_hi, 0))
    for t0 in range(start, far_end, BLOCK_N):
        o_n = t0 + tl.arange(0, BLOCK_N)
        m_n = o_n < far_end
        ka, kb, kp, v = _load_kv(p_k0, p_v0, stride_kn, stride_vn, o_n, m_n, d_a, d_b, d_p, m_half, m_pass, o_d, m_d, UPCAST)
        if KEYS_ROTATED:
            ka32, kb32 = _rotate(ka.to(tl.float32), kb.to(tl.float32), -o_n.to(tl.float32), inv_freq)
            ka = ka32.to(kp.dtype)
            kb = kb32.to(kp.dtype)
        s = _logits(qfa, qfb, qfp, ka, kb, kp, HAS_PASS, DOT_PRECISION)
        s = tl.where(m_n[None, :] & (o_n[None, :] < o_ws[:, None]), s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)
    _store_state(p_o + stride_obr, p_l + stride_lbr, m_i, l_i, acc, m_store, m_row)

    # window: j >= win_lo + r, exact positions (always written; an empty split writes (0, -inf))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t0 in range(tl.maximum(start, tl.maximum(win_lo, 0)), end, BLOCK_N):
        o_n = t0 + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        ka, kb, kp, v = _load_kv(p_k0, p_v0, stride_kn, stride_vn, o_n, m_n, d_a, d_b, d_p, m_half, m_pass, o_d, m_d, UPCAST)
        if not KEYS_ROTATED:
            ka32, kb32 = _rotate(ka.to(tl.float32), kb.to(tl.float32), (o_n - n_ctx).to(tl.float32), inv_freq)
            ka = ka32.to(kp.dtype)
            kb = kb32.to(kp.dtype)
        s = _logits(qwa, qwb, qwp, ka, kb, kp, HAS_PASS, DOT_PRECISION)
        s = tl.where(m_n[None, :] & (o_n[None, :] >= o_ws[:, None]), s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION)
    _store_state(p_o, p_l, m_i, l_i, acc, m_store, m_row)


@triton.jit
def _merge_splits(p_o, p_lse, stride_os, o_s, m_s, o_d, m_d):
    # merge one row's split states (base-2 LSE) -> (o [BLOCK_D], lse2)
    lse = tl.load(p_lse + o_s, mask=m_s, other=float("-inf"))      # [BLOCK_S]
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)                                         # 0 for empty states
    o = tl.load(p_o + o_s[:, None] * stride_os + o_d[None, :],       # [BLOCK_S, BLOCK_D]
                mask=(w > 0.0)[:, None] & m_d[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    lse_out = tl.where(total > 0.0, m_safe + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    return o, lse_out


@triton.jit
def fold_fwd_kernel_stage2(
    OPart, LsePart, Out, Lse,
    stride_ob, stride_oh, stride_or, stride_obr, stride_os,
    stride_lb, stride_lh, stride_lr, stride_lbr,
    stride_outb, stride_outn, stride_outh,
    stride_lseb, stride_lsen,
    heads_q, num_splits, inv_alpha,
    N_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    i_b = (pid // (heads_q * N_Q)).to(tl.int64)
    i_hq = ((pid // N_Q) % heads_q).to(tl.int64)
    i_r = (pid % N_Q).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM

    p_o = OPart + i_b * stride_ob + i_hq * stride_oh + i_r * stride_or
    p_l = LsePart + i_b * stride_lb + i_hq * stride_lh + i_r * stride_lr
    o_w, lse_w = _merge_splits(p_o, p_l, stride_os, o_s, m_s, o_d, m_d)
    o_f, lse_f_alpha = _merge_splits(p_o + stride_obr, p_l + stride_lbr, stride_os, o_s, m_s, o_d, m_d)
    lse_f = lse_f_alpha * inv_alpha                                   # log2 Z_F = LSE2(alpha * logits) / alpha

    m = tl.maximum(lse_w, lse_f)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_w = tl.exp2(lse_w - m_safe)
    w_f = tl.exp2(lse_f - m_safe)
    total = w_w + w_f
    out = (w_w * o_w + w_f * o_f) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + i_b * stride_outb + i_r * stride_outn + i_hq * stride_outh + o_d,
             out.to(Out.dtype.element_ty), mask=m_d)
    if RETURN_LSE:
        lse2 = tl.where(total > 0.0, m_safe + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        tl.store(Lse + i_b * stride_lseb + i_r * stride_lsen + i_hq, lse2 * 0.6931471805599453)  # base 2 -> e


def fold_attention_fwd(q, k, v, inv_freq, cache_seqlens, *, window, alpha, softmax_scale, rotary_dim,
                       interleaved, attention_factor, keys_rotated, return_lse, config: FoldConfig, out_dtype=None):
    """Launch both stages. Assumes validated inputs (see ``fold.attention``); returns ``(out, lse or None)``.

    q [B, n_q, Hq, d]; k, v [B, max_len, Hkv, d]; inv_freq [rotary_dim/2] fp32 on q's device;
    cache_seqlens [B] int or None; ``out_dtype`` defaults to q's (float32 keeps a state for merging).
    """
    batch, n_q, heads_q, head_dim = q.shape
    max_len, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    rows = n_q * group
    m_tiles = triton.cdiv(rows, config.block_m)
    rot_half = rotary_dim // 2
    n_pass = head_dim - rotary_dim
    splits = config.num_splits
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    # the rotary factor f scales q and k alike: q carries f for itself and, with unrotated keys,
    # for the key too (with rotated keys the cache already holds it; un-rotating is a pure rotation)
    q_rot_scale = attention_factor if keys_rotated else attention_factor * attention_factor
    upcast = INTERPRETED and q.dtype == torch.bfloat16

    o_part = torch.empty(batch, heads_q, n_q, 2, splits, head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(batch, heads_q, n_q, 2, splits, device=q.device, dtype=torch.float32)
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty(batch, n_q, heads_q, device=q.device, dtype=torch.float32) if return_lse else out
    seqlens = cache_seqlens if cache_seqlens is not None else q  # dummy pointer when unused

    fold_fwd_kernel_stage1[(batch * heads_kv * m_tiles, splits)](
        q, k, v, inv_freq, seqlens, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3), o_part.stride(4),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), lse_part.stride(3),
        heads_kv, max_len, window, splits, q_rot_scale, softmax_scale * LOG2E, alpha * softmax_scale * LOG2E,
        N_Q=n_q, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        ROT_HALF=rot_half, HALF_P=max(16, triton.next_power_of_2(rot_half)),
        PASS=n_pass, PASS_P=max(16, triton.next_power_of_2(max(n_pass, 1))),
        INTERLEAVED=interleaved, KEYS_ROTATED=keys_rotated, HAS_SEQLENS=cache_seqlens is not None,
        M_TILES=m_tiles, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        UPCAST=upcast, DOT_PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    fold_fwd_kernel_stage2[(batch * heads_q * n_q,)](
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3), o_part.stride(4),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), lse_part.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        heads_q, splits, 1.0 / alpha,
        N_Q=n_q, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), RETURN_LSE=return_lse,
        num_warps=4 if head_dim >= 128 else 2,
    )
    return out, (lse if return_lse else None)

