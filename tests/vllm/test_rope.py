"""``fold.vllm.models.rope_of`` against vLLM's own rotary embeddings: every rope type vLLM can give a
drafter that ``fold.Rope`` expresses, in the dtypes models are served in, applied at random positions
by vLLM and by fold."""

import pytest
import torch

import fold
from fold.vllm.models import rope_of
from reference import apply_rope
from reference.tolerance import check_close

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

HEAD = 64
MAX_POS = 4096
ROPES = {
    "default": dict(rope_type="default", rope_theta=1e4),
    "partial": dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
    "linear": dict(rope_type="linear", rope_theta=1e4, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=1e4, factor=2.0, max_trained_positions=2048),
    "dynamic-alpha": dict(rope_type="dynamic", rope_theta=1e4, alpha=3.0),
    "llama3": dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=1024),
    "yarn": dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=1024),
    "yarn-mscale": dict(rope_type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=2048,
                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.5),
}


@pytest.fixture(autouse=True)
def vllm_config():
    """vLLM's rotary embeddings are custom ops, built under a current config (as inside an engine)."""
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_of_reproduces_vllms_rotary_embedding(name, neox, dtype):
    """Keys rotated by vLLM (its table in the model's dtype) and by the recovered Rope in float64 agree
    within twice PyTorch's own error of that rotation in the dtype (float32 angles, as transformers and
    vLLM form them), at random positions across the table."""
    rotary = get_rope(HEAD, MAX_POS, is_neox_style=neox, rope_parameters=ROPES[name], dtype=dtype)
    rope = rope_of(rotary)
    assert isinstance(rope, fold.Rope) and rope.rotary_dim == rotary.rotary_dim and rope.interleaved != neox
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, rotary.cos_sin_cache.shape[0], (64,), generator=g)
    x = torch.randn(64, 2, HEAD, generator=g)
    _, theirs = rotary.forward_native(positions, x.flatten(1).to(dtype), x.flatten(1).to(dtype))
    kw = dict(rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, attention_factor=rope.attention_factor)
    truth = apply_rope(x.double(), positions[:, None], rope.inv_freq, **kw)
    twin = apply_rope(x.to(dtype), positions[:, None], rope.inv_freq, **kw)
    check_close(f"{name} vLLM vs fold", theirs.view(64, 2, HEAD), truth, twin, dtype)


def test_a_table_fold_cannot_express_is_refused():
    rotary = get_rope(HEAD, MAX_POS, rope_parameters=ROPES["default"], dtype=torch.float32)
    broken = get_rope(HEAD, MAX_POS + 8, rope_parameters=ROPES["default"], dtype=torch.float32)
    broken.cos_sin_cache[100:] = rotary.cos_sin_cache[:MAX_POS + 8 - 100].clone()   # the table shifted
    with pytest.raises(ValueError, match="cannot reproduce this drafter's rotary embedding"):
        rope_of(broken)
