"""fold.Rope against transformers' own rotary embeddings."""

import pytest
import torch

import fold
from reference import apply_rope
from reference.tolerance import check_close

transformers = pytest.importorskip("transformers")


def _hf_cos_sin(config, positions):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    emb = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(positions), 1)
    return emb(x, positions[None])


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
])
def test_from_config_rotates_like_transformers(rope_parameters):
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32768, rope_parameters=rope_parameters)
    rope = fold.Rope.from_config(config)
    positions = torch.tensor([0, 1, 17, 4095, 30000])
    cos, sin = _hf_cos_sin(config, positions)                    # [1, P, head_dim]
    x = torch.randn(len(positions), 64)
    from transformers.models.llama.modeling_llama import rotate_half
    want = x * cos[0] + rotate_half(x) * sin[0]                  # transformers' rotation, float32
    truth = x.double() * cos[0].double() + rotate_half(x.double()) * sin[0].double()
    got = apply_rope(x, positions, rope.inv_freq, rotary_dim=rope.rotary_dim, attention_factor=rope.attention_factor)
    check_close("rotated like transformers", got, truth, want, torch.float32)


def test_from_config_partial_rotary_factor():
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})
    rope = fold.Rope.from_config(config)
    assert rope.rotary_dim == 32
    torch.testing.assert_close(rope.inv_freq, fold.Rope.from_theta(10000.0, 64, rotary_dim=32).inv_freq)


def test_from_theta_matches_the_llama_formula():
    rope = fold.Rope.from_theta(500000.0, 128)
    want = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    assert rope.rotary_dim == 128 and torch.equal(rope.inv_freq, want)
