"""Hybrid tree attention in Triton: configs -> jit kernel -> launcher.

The committed cache is read by FOLD's split-K stage-1/stage-2 kernels as a plain read
(:func:`~fold.kernels.fold_attention.plain_attention_fwd`: queries and keys arrive rotated, every
row reads every valid entry), giving a state ``(o_c, lse_c)`` per row. One small kernel then attends
each row (tree node x GQA head, packed per KV head) to the tree nodes under ``tree_mask`` and merges
the result with the cached state in its epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fold.kernels.fold_attention import INTERPRETED, LN2, LOG2E, FoldConfig, program_rows, plain_attention_fwd
from fold.kernels.launch import launcher


@dataclass(frozen=True)
class TreeConfig:
    """Launch of the tree kernel: the tree is one tile (n_tree is small); ``block_m`` rows (tree node x
    GQA head) per program, a power of two >= 16."""

    block_m: int = 32
    num_warps: int = 4


TREE_CONFIG = TreeConfig()


@triton.jit(do_not_specialize=["n_tree"])
def tree_fwd_kernel(
    Q, KT, VT, Mask, OC, LseC, Out, Lse,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_mb, stride_mi,
    stride_cb, stride_cn, stride_ch,
    stride_lcb, stride_lcn,
    stride_outb, stride_outn, stride_outh,
    stride_lseb, stride_lsen,
    heads_kv, n_tree, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr, M_TILES: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    # rows m = node * GROUP + h
    i_b, i_kvh, o_m, m_row, o_i, i_hq = program_rows(tl.program_id(0), heads_kv, n_tree * GROUP, GROUP, M_TILES,
                                                      BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < n_tree

    q = tl.load(Q + i_b * stride_qb + o_i[:, None] * stride_qn + i_hq[:, None] * stride_qh + o_d[None, :],
                mask=m_row[:, None] & m_d[None, :], other=0.0).to(tl.float32) * scale_log2
    k = tl.load(KT + i_b * stride_kb + o_t[:, None] * stride_kn + i_kvh * stride_kh + o_d[None, :],
                mask=m_t[:, None] & m_d[None, :], other=0.0)
    v = tl.load(VT + i_b * stride_vb + o_t[:, None] * stride_vn + i_kvh * stride_vh + o_d[None, :],
                mask=m_t[:, None] & m_d[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 arithmetic is broken; casts are exact
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        q = q.to(KT.dtype.element_ty)
    visible = tl.load(Mask + i_b * stride_mb + o_i[:, None] * stride_mi + o_t[None, :],
                      mask=m_row[:, None] & m_t[None, :], other=0) != 0               # [BM, BT]

    # [BM, BD] @ [BD, BT] -> [BM, BT], base-2 logits
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = tl.where(visible, s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    l_t = tl.sum(p, 1)                      # guards test exact zeros, so a NaN input stays NaN
    o_tree = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION) / tl.where(l_t == 0.0, 1.0, l_t)[:, None]
    lse_t = m_safe + tl.log2(l_t)           # -inf for a row that sees no node

    # merge with the cached state (its LSE arrives in base 2; converted to natural log once, at the store)
    lse_c = tl.load(LseC + i_b * stride_lcb + o_i * stride_lcn + i_hq, mask=m_row, other=float("-inf"))  # base 2
    mx = tl.maximum(lse_c, lse_t)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w_c = tl.exp2(lse_c - mx)
    w_t = tl.exp2(lse_t - mx)
    o_c = tl.load(OC + i_b * stride_cb + o_i[:, None] * stride_cn + i_hq[:, None] * stride_ch + o_d[None, :],
                  mask=(m_row & (w_c != 0.0))[:, None] & m_d[None, :], other=0.0)
    total = w_c + w_t
    out = (w_c[:, None] * o_c + w_t[:, None] * o_tree) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(Out + i_b * stride_outb + o_i[:, None] * stride_outn + i_hq[:, None] * stride_outh + o_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
    if RETURN_LSE:
        lse = mx + tl.log2(total)
        # base 2 -> e
        tl.store(Lse + i_b * stride_lseb + o_i * stride_lsen + i_hq, lse * LN2, mask=m_row)


def tree_attention_fwd(q, k_cache, v_cache, k_tree, v_tree, tree_mask, cache_seqlens, *, softmax_scale, return_lse,
                       config: FoldConfig, tree_config: TreeConfig = TREE_CONFIG, block_table=None):
    """Launch the cached read (with ``config``) and the tree kernel (with ``tree_config``). Assumes
    validated inputs; returns ``(out, lse or None)``. With ``block_table`` the cache is paged as in
    :func:`~fold.kernels.fold_attention.fold_attention_fwd`."""
    batch, n_tree, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    o_c, lse_c = plain_attention_fwd(q, k_cache, v_cache, cache_seqlens, softmax_scale=softmax_scale, config=config,
                                     out_dtype=torch.float32, block_table=block_table, lse_base2=True)
    block_m = tree_config.block_m
    m_tiles = triton.cdiv(n_tree * group, block_m)
    out = torch.empty_like(q)
    lse = torch.empty(batch, n_tree, heads_q, device=q.device, dtype=torch.float32) if return_lse else out
    mask = tree_mask.to(torch.int8)
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    launcher(tree_fwd_kernel, (batch * heads_kv * m_tiles,))(
        q, k_tree, v_tree, mask, o_c, lse_c, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        mask.stride(0), mask.stride(1),
        o_c.stride(0), o_c.stride(1), o_c.stride(2),
        lse_c.stride(0), lse_c.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        heads_kv, n_tree, softmax_scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_T=max(16, triton.next_power_of_2(n_tree)), M_TILES=m_tiles, UPCAST=upcast,
        DOT_PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32", RETURN_LSE=return_lse,
        num_warps=tree_config.num_warps,
    )
    return out, (lse if return_lse else None)
