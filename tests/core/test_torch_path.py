"""The torch path's pieces: fold.rope.rotate and its tables, and the chunked reads (rotated or
gathered keys, read a chunk at a time) against the reference."""

import pytest
import torch
from hypothesis import given, settings

import fold
import fold.torch_path as torch_backend
from reference import apply_rope
from reference.tolerance import check_close
from tests.helpers import check_against_reference
from tests.helpers import cases


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotate_matches_the_reference_at_any_position(interleaved, rotary_dim, dtype):
    inv_freq = fold.Rope.from_theta(10000.0, 32, rotary_dim=rotary_dim).inv_freq
    rope = fold.Rope(inv_freq, interleaved=interleaved, attention_factor=1.3)
    x = torch.randn(3, 6, 32, dtype=torch.float64)
    pos = torch.tensor([0, 1, -5, 4097, 131071, -262143])
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, attention_factor=1.3)
    truth = apply_rope(x, pos[None, :], inv_freq, **kw)
    got = fold.rope.rotate(x.to(dtype), pos, rope)
    assert got.dtype == dtype
    # float64 angles: only the rounding of the result, no allowance for float32 angles (PyTorch's own
    # rotation in float32 is off by ~1e-2 at position 262143)
    check_close("rotate", got, truth, truth, dtype)
    back = fold.rope.rotate(fold.rope.rotate(x, pos, rope, factor=1.0), -pos, rope, factor=1.0)
    torch.testing.assert_close(back, x)                                   # float64: R_-p R_p = I


@pytest.mark.parametrize("start, count", [(0, 10), (5000, 300), (-2058, 2068), (-3, 3)])
def test_cos_sin_tables_are_exact_and_inverse_rotates_back(start, count):
    rope = fold.Rope.from_theta(500000.0, 64)
    cos, sin = rope.cos_sin(start, count, dtype=torch.float64, device="cpu")
    angle = torch.arange(start, start + count, dtype=torch.float64)[:, None] * rope.inv_freq.double()
    assert torch.equal(cos, torch.cos(angle)) and torch.equal(sin, torch.sin(angle))
    again = rope.cos_sin(start, count, dtype=torch.float64, device="cpu")[0]
    assert again.data_ptr() == cos.data_ptr()                 # kept (a slice of the table, or the stored range)
    x = torch.randn(count, 2, 64, dtype=torch.float64)
    there = fold.rope.rotate_with(x, cos[:, None], sin[:, None], rope)
    torch.testing.assert_close(fold.rope.rotate_with(there, cos[:, None], sin[:, None], rope, inverse=True), x)
    pos = torch.arange(start, start + count)
    torch.testing.assert_close(there.transpose(0, 1), fold.rope.rotate(x.transpose(0, 1), pos, rope, factor=1.0))


@settings(max_examples=30)
@given(case=cases(dtypes=[torch.float32, torch.bfloat16, torch.float64], max_len_cap=1500))
def test_chunked_reads_match_the_reference(case):
    """With 64-entry chunks every rotated or copied segment is read in many pieces merged online."""
    mp = pytest.MonkeyPatch()
    mp.setattr(torch_backend, "CHUNK_BYTES", 1)
    try:
        check_against_reference(case, backend="torch")
    finally:
        mp.undo()


def test_the_kept_rotation_buffer_serves_reads_in_and_out_of_inference_mode():
    """The torch path keeps one buffer per thread for a chunk's rotated keys: made under
    ``torch.inference_mode`` (a drafting loop), it must stay writable by a later read outside it."""
    from fold import torch_path

    torch_path._SCRATCH.__dict__.clear()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=g), torch.randn(1, 64, 2, 16, generator=g),
               torch.randn(1, 64, 2, 16, generator=g))
    kw = dict(window=8, rope=fold.Rope.from_theta(10000.0, 16), backend="torch")
    with torch.inference_mode():
        inside = fold.attention(q, k, v, **kw)
    outside = fold.attention(q, k, v, **kw)
    assert torch.equal(inside, outside)
