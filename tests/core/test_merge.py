"""fold.merge_states against the reference merge."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fold
from reference import merge_states_ref
from reference.tolerance import check_close


@given(n_states=st.integers(1, 5), empty=st.lists(st.booleans(), min_size=5, max_size=5),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 1000))
def test_merge_matches_reference(n_states, empty, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 4)
    outputs = [torch.randn(*shape, 8, generator=g).to(dtype) for _ in range(n_states)]
    lses = [torch.randn(shape, generator=g) * 5 for _ in range(n_states)]
    for i in range(n_states):
        if empty[i]:
            lses[i][0] = float("-inf")                    # an empty segment for some rows
            outputs[i][0] = float("nan")                  # whose o must never be trusted
    o, lse = fold.merge_states(outputs, lses)
    o_ref, lse_ref = merge_states_ref([x.double().nan_to_num() for x in outputs], [x.double() for x in lses])
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any()
    o_lp, lse_lp = merge_states_ref([x.nan_to_num() for x in outputs], lses)   # the same math in dtype / float32
    check_close("o", o, o_ref, o_lp, dtype)
    check_close("lse", lse, lse_ref, lse_lp, torch.float32)


def test_all_empty_merges_to_zero_and_minus_inf():
    o, lse = fold.merge_states([torch.full((2, 4), float("nan"))] * 2, [torch.full((2,), float("-inf"))] * 2)
    assert torch.equal(o, torch.zeros(2, 4)) and torch.equal(lse, torch.full((2,), float("-inf")))


def test_flash_attention_2_plus_inf_empty_marker_is_read_as_empty():
    o, lse = fold.merge_states([torch.ones(1, 4), torch.full((1, 4), 3.0)], [torch.tensor([float("inf")]), torch.tensor([0.5])])
    assert torch.equal(o, torch.full((1, 4), 3.0)) and lse.item() == 0.5


@pytest.mark.parametrize("outputs, lses, error, words", [
    ([], [], ValueError, "non-empty and of equal length"),
    ([torch.zeros(2, 4)], [torch.zeros(3)], ValueError, "lses[0] must have shape (2,)"),
    ([torch.zeros(2, 4), torch.zeros(2, 5)], [torch.zeros(2)] * 2, ValueError, "outputs[1] must have shape (2, 4)"),
    ([torch.zeros(2, 4)], [[0.0, 0.0]], TypeError, "must be torch.Tensors"),
])
def test_bad_states_raise(outputs, lses, error, words):
    with pytest.raises(error) as info:
        fold.merge_states(outputs, lses)
    assert words in str(info.value)
