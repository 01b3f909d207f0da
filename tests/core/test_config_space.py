"""Every configuration the tuner may pick computes the same FOLD read (interpreter, small shapes)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from fold.config_lookup import use_config
from fold.kernels.fold_attention import SPACE, config_space, keep
from tests.helpers import INTERPRETED, Case, check_against_reference


@st.composite
def case_and_config(draw):
    n_q = draw(st.sampled_from([1, 4, 7, 10, 16]))
    group = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    max_len = draw(st.integers(n_q, 300))   # 128 splits x programs is slow in the interpreter
    case = Case(batch=1, n_q=n_q, heads_kv=1, group=group, head_dim=head_dim,
                rotary_dim=head_dim, max_len=max_len, window=draw(st.integers(0, 64)),
                alpha=draw(st.floats(1.0, 8.0)), keys_rotated=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.float16])), seed=draw(st.integers(0, 999)))
    config = draw(st.sampled_from(config_space(n_q * group, head_dim)))
    return case, config


@INTERPRETED
@given(case_and_config())
def test_configs_of_the_declared_space_match_the_reference(case_config):
    case, config = case_config
    with use_config(config):
        check_against_reference(case, backend="triton")


def test_the_space_keeps_the_tiles_every_drafter_needs():
    for rows in (28, 32, 40, 64, 128):             # n_q x group of the supported drafters
        space = config_space(rows, 128)
        assert space and all(keep(c, rows, 128) for c in space)
        assert {c.num_splits for c in space} == set(SPACE["num_splits"])
