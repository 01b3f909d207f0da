"""``fold.vllm.models.install`` on stand-in drafter modules: which layers fold serves, and what it
refuses at start-up. vLLM's ``Attention`` class is replaced by a stand-in so that no engine is built."""

from types import SimpleNamespace

import pytest
import torch

import fold.vllm
from fold.vllm import compat, models
from fold.vllm.backend import FoldAttentionImpl

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

HEAD = 64


class StandInAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.impl = SimpleNamespace(num_heads=4, head_size=HEAD, scale=HEAD ** -0.5, num_kv_heads=2)
        self.kv_cache_dtype, self.sliding_window = "auto", 64


class _NoRope(torch.nn.Module):
    """Like vLLM 0.34's ``ricursive_dflash2._NoRope``: rotates nothing, keeps the real rotary's table.
    Every other attribute is the wrapped rotary's, so a table check alone would pass it."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope
        self.cos_sin_cache = rope.cos_sin_cache

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["rope"], name)

    def forward(self, positions, query, key):
        return query, key


class Layer(torch.nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.attn, self.rotary_emb, self.causal = StandInAttention(), rotary, False


def _config(dcp=1):
    hf = SimpleNamespace(fold=dict(read="fold", window=16, alpha=2.0))
    return SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf),
                                                              num_speculative_tokens=3),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=dcp))


@pytest.fixture
def rope(monkeypatch):
    monkeypatch.setattr(compat, "Attention", StandInAttention)
    fold.vllm.register()                                      # the FOLD backend name install() sets
    with set_current_vllm_config(VllmConfig()):
        yield lambda: get_rope(HEAD, max_position=4096, is_neox_style=True,
                               rope_parameters=dict(rope_type="default", rope_theta=1e4))


def test_a_nope_layer_keeps_vllms_read_and_the_rotary_layers_get_folds(rope):
    model = torch.nn.ModuleDict(dict(rotary=Layer(rope()), nope=Layer(_NoRope(rope()))))
    stock = model["nope"].attn.impl
    assert models.rope_of(model["nope"].rotary_emb) is not None      # the table alone looks rotary
    assert models.install(model, _config()) == 1
    assert isinstance(model["rotary"].attn.impl, FoldAttentionImpl)
    assert model["rotary"].attn.sliding_window is None                 # fold keeps every page of its layers
    assert model["nope"].attn.impl is stock and model["nope"].attn.sliding_window == 64


def test_decode_context_parallelism_is_refused_naming_the_field(rope):
    model = torch.nn.ModuleDict(dict(rotary=Layer(rope())))
    with pytest.raises(ValueError, match="draft_decode_context_parallel_size=1"):
        models.install(model, _config(dcp=2))
    assert not isinstance(model["rotary"].attn.impl, FoldAttentionImpl)
