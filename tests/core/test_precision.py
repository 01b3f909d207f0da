"""Rounding and memory faults found by porting flash-attention's kvcache grid (issue 43), each pinned by
its smallest reproduction: half-precision partial states rounded twice on the torch path, a rounded
``scale * log2(e)`` product in the Triton kernels' LSE, and a RoPE table sized by ``window`` for a read
that rotates nothing. Judged by flash-attention's own rule (``reference.tolerance.check_flash_rule``),
which is stricter than the suite's floor for half-precision outputs."""

import pytest
import torch
import torch.nn.functional as F

import fold
import fold.ops
from reference import fold_attention_ref
from reference.tolerance import check_flash_rule

PLAIN = dict(far_position="none", keys_rotated=True, queries_rotated=True)


def _inputs(seed, shape_q, shape_k, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g)
    k = torch.randn(*shape_k, generator=g)
    v = torch.randn(*shape_k, generator=g) * 2
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_the_torch_path_rounds_a_half_read_once():
    """One fp16 query over 4 keys (d 16): the CPU flash kernel's partial state was rounded to fp16, merged in
    float32 with the block's entries and rounded again (seed 5: 2.0625 where the truth is 2.06416 and
    PyTorch's fp16 SDPA gives 2.06445; the worst of these seeds erred 4.7 times SDPA's error). Judged against
    PyTorch's fused fp16 read of the same keys by flash-attention's rule."""
    rope = fold.Rope.from_theta(10000.0, 16)
    for seed in range(200):
        q, k, v = _inputs(seed, (1, 1, 1, 16), (1, 4, 1, 16), torch.float16)
        kw = dict(window=4, rope=rope, **PLAIN)
        out = fold.attention(q, k, v, **kw, backend="torch")
        truth, _ = fold_attention_ref(q, k, v, **kw)
        sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        check_flash_rule(f"seed {seed} out", out, truth, sdpa)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_triton_lse_carries_no_rounded_scale(dtype):
    """One key per row: the LSE is the scaled logit itself. The kernels stored q times ``scale * log2 e`` in
    the cache's dtype, and that product's rounding reached the LSE (fp16: 1.8e-3, as large as PyTorch's own
    fp16 error). Now the scale multiplies the float32 dot, so the LSE is as good as a float32 computation of
    the same (half) inputs; the output is held to the rule in its own dtype."""
    rope = fold.Rope.from_theta(10000.0, 64)
    for seed in range(24):
        q, k, v = _inputs(seed, (2, 1, 4, 64), (2, 1, 2, 64), dtype)
        q = q * 3
        kw = dict(window=0, rope=rope, **PLAIN)
        out, lse = fold.attention(q, k, v, **kw, return_lse=True, backend="triton")
        truth, truth_lse = fold_attention_ref(q, k, v, **kw)
        lp, _ = fold_attention_ref(q, k, v, upcast=False, **kw)
        _, lp32_lse = fold_attention_ref(q.float(), k.float(), v.float(), upcast=False, **kw)
        check_flash_rule(f"seed {seed} out", out, truth, lp)
        check_flash_rule(f"seed {seed} lse", lse, truth_lse, lp32_lse)


@pytest.mark.parametrize("queries_rotated", [False, True])
def test_a_read_builds_tables_only_for_the_positions_it_reads(queries_rotated):
    """``far_position="none"`` with a window of 10**6: the old torch path rotated the far queries anyway and
    built a cos/sin table up to the next power of two above ``window + n_q`` (768 MiB, 3 s). A read of
    rotated keys and queries rotates nothing and builds no table; unrotated queries need theirs at the
    block's positions only."""
    fold.ops._ROPES.clear()
    rope = fold.Rope(torch.linspace(1.0, 1e-4, 8, dtype=torch.float32) * 0.731)     # a Rope no other test uses
    q, k, v = _inputs(0, (1, 4, 2, 16), (1, 40, 2, 16), torch.float32)
    fold.attention(q, k, v, window=10**6, rope=rope, far_position="none", keys_rotated=True,
                   queries_rotated=queries_rotated, backend="torch")
    (used,) = fold.ops._ROPES.values()
    rows = [cos.shape[0] for cos, _ in used._tables.values()] + [cos.shape[0] for cos, _ in used._ranges.values()]
    if queries_rotated:
        assert rows == []
    else:
        assert rows and max(rows) <= 4096                  # the table's smallest size, covering positions < 40
