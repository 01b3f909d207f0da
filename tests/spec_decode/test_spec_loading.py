"""Drafter checkpoints in each real format load through spec_decode.load_drafter; bad ones fail clearly."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fold import spec_decode
from fold.spec_decode.loading import build_target_layer_ids
from tests.spec_decode_fixtures import make_drafter, make_target, rewrite_config


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target("llama", tmp_path_factory.mktemp("target"))


@pytest.mark.parametrize("fmt, slots_from_anchor, markov", [
    ("zlab", False, 0), ("zlab-legacy", False, 0), ("deepspec-dflash", True, 0), ("dspark", True, 8)])
def test_each_format_loads_with_its_conventions(tmp_path, target, fmt, slots_from_anchor, markov):
    drafter = spec_decode.load_drafter(make_drafter(tmp_path / fmt, target, fmt, block_size=5, taps=(0, 2)), target)
    cfg = drafter.cfg
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (5, [0, 2], 96)
    assert cfg.sample_from_anchor is slots_from_anchor and cfg.markov_rank == markov
    assert cfg.has_embeddings is slots_from_anchor                 # DeepSpec ships embed/head copies
    assert next(drafter.parameters()).dtype == torch.float32       # the target's dtype
    state_keys = set(drafter.state_dict())
    assert not any(k.startswith("_target") for k in state_keys)    # the target is referenced, not owned


def test_the_tap_reads_output_of_layer_i(tmp_path, target):
    drafter = spec_decode.load_drafter(make_drafter(tmp_path / "d", target, "zlab", taps=(0, 2)), target)
    hidden = tuple(torch.full((1, 3, 64), float(i)) for i in range(5))  # embeddings, then layers 0..3
    feats = drafter.features(hidden)
    assert feats[0, 0, 0] == 1 and feats[0, 0, 64] == 3


def test_default_tap_ids_follow_zlab():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]




@pytest.mark.parametrize("changes, words", [
    (dict(hidden_size=32), "drafter hidden_size=32 != target hidden_size=64"),
    (dict(vocab_size=50, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 40}),
     "drafter vocab_size=50 != target vocab_size=97"),
    (dict(dflash_config={"target_layer_ids": [0, 3], "mask_token_id": 96}), "target_layer_ids [3] out of range"),
    (dict(architectures=["DFlash2DraftModel"]), "a DFlash2DraftModel needs conv_kernel_size"),
    (dict(architectures=["EagleModel"], dflash_config=None), "unknown drafter architecture 'EagleModel'"),
    (dict(intermediate_size=None), "has no 'intermediate_size'"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
     "has sliding_attention layers but use_sliding_window is None"),
    (dict(is_causal=True), "makes full-attention layers causal over the block"),
    (dict(dflash_config={"target_layer_ids": [0, 2]}), "has no mask_token_id"),
    (dict(dflash_config={"target_layer_ids": [0, 1, 2], "mask_token_id": 96}), "fc.weight takes 128 features"),
])
def test_bad_checkpoints_fail_naming_the_field(tmp_path, target, changes, words):
    path = make_drafter(tmp_path / "d", target, "zlab")
    rewrite_config(path, **changes)
    with pytest.raises(ValueError) as info:
        spec_decode.load_drafter(path, target)
    assert words in str(info.value)


def test_unknown_markov_head_is_refused(tmp_path, target):
    path = make_drafter(tmp_path / "d", target, "dspark")
    rewrite_config(path, markov_head_type="gated")
    with pytest.raises(ValueError, match="markov_head_type 'gated' is not supported"):
        spec_decode.load_drafter(path, target)


def test_missing_weights_are_named(tmp_path, target):
    path = make_drafter(tmp_path / "d", target, "zlab")
    state = load_file(str(path / "model.safetensors"))
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['layers.1.mlp.up_proj.weight'\\]"):
        spec_decode.load_drafter(path, target)


def test_not_a_directory_of_a_drafter(tmp_path, target):
    with pytest.raises(ValueError, match="no config.json"):
        spec_decode.load_drafter(tmp_path, target)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(max_new_tokens=4, policy="h2o"), "policy must be one of"),
    (dict(max_new_tokens=4, attention_mask=torch.ones(1, 3)), "attention_mask must be a tensor of input_ids' shape"),
])
def test_bad_generate_arguments(tmp_path, target, kwargs, words):
    drafter = spec_decode.load_drafter(make_drafter(tmp_path / "d", target, "zlab"), target)
    with pytest.raises(ValueError) as info:
        spec_decode.generate(target, drafter, torch.tensor([[1, 2, 3, 4, 5]]), **kwargs)
    assert words in str(info.value)


# -- broken files and fields: a ValueError/TypeError naming the file and the field, at load time --

@pytest.mark.parametrize("content, words", [
    (b"{not json", "config.json: not valid JSON"),
    (b"[1, 2]", "config.json: must hold a JSON object, got a list"),
    (b"\xff\xfe\x00", "config.json: cannot be read"),
])
def test_invalid_config_json_is_named(tmp_path, target, content, words):
    path = make_drafter(tmp_path / "d", target, "zlab")
    (path / "config.json").write_bytes(content)
    with pytest.raises(ValueError) as info:
        spec_decode.load_drafter(path, target)
    assert words in str(info.value)


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_are_named(tmp_path, target, cut):
    path = make_drafter(tmp_path / "d", target, "zlab")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:len(data) // 2], "garbage": b"\x00" * 64, "empty": b""}[cut])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        spec_decode.load_drafter(path, target)


def test_a_missing_shard_is_named(tmp_path, target):
    path = make_drafter(tmp_path / "d", target, "zlab")
    (path / "model.safetensors").rename(path / "shard-1.safetensors")
    weight_map = {"fc.weight": "shard-1.safetensors", "norm.weight": "shard-2.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="shard-2.safetensors: missing"):
        spec_decode.load_drafter(path, target)


@pytest.mark.parametrize("changes, error, words", [
    (dict(architectures="DFlashDraftModel"), TypeError, "architectures must be a list of strings"),
    (dict(dflash_config=[1]), TypeError, "dflash_config must be an object"),
    (dict(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 97}), ValueError,
     "mask_token_id=97 is outside the vocabulary (vocab_size=97)"),
    (dict(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": -1}), ValueError,
     "mask_token_id must be an int >= 0"),
    (dict(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 96, "block_size": 0}), ValueError,
     "block_size must be an int >= 2, got 0"),
    (dict(dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 96, "block_size": 1}), ValueError,
     "block_size must be an int >= 2, got 1"),
    (dict(dflash_config={"target_layer_ids": "0,2", "mask_token_id": 96}), TypeError,
     "target_layer_ids must be a non-empty list of ints"),
    (dict(hidden_size="64"), TypeError, "hidden_size must be an int >= 1, got '64'"),
    (dict(num_key_value_heads=3), ValueError, "num_attention_heads=4 must be a multiple of the key/value heads (3)"),
    (dict(rms_norm_eps=0), ValueError, "rms_norm_eps must be a finite number > 0"),
])
def test_bad_fields_are_named_at_load_time(tmp_path, target, changes, error, words):
    path = make_drafter(tmp_path / "d", target, "zlab")
    rewrite_config(path, **changes)
    with pytest.raises(error) as info:
        spec_decode.load_drafter(path, target)
    assert words in str(info.value) and "config.json" in str(info.value)


def test_deepspec_block_size_must_be_positive(tmp_path, target):
    path = make_drafter(tmp_path / "d", target, "dspark")
    rewrite_config(path, block_size=0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        spec_decode.load_drafter(path, target)


@pytest.mark.parametrize("fmt", ["zlab", "zlab-legacy", "deepspec-dflash", "dspark"])
def test_a_drafter_directory_is_refused_as_a_target_before_any_weights_load(tmp_path, target, fmt, monkeypatch):
    from fold.spec_decode.loading import check_target_dir, drafter_kind

    path = make_drafter(tmp_path / fmt, target, fmt)
    assert "drafter" in drafter_kind(path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="is a DFlash/DSpark drafter .*, not a target: a target directory holds"):
        check_target_dir(path)


def test_a_target_directory_is_refused_as_a_drafter_naming_what_it_is(tmp_path, target):
    from fold.spec_decode.loading import check_target_dir, drafter_kind

    target.save_pretrained(tmp_path / "t")
    assert drafter_kind(tmp_path / "t") is None
    check_target_dir(tmp_path / "t")                                   # a target passes
    with pytest.raises(ValueError, match=r"is a target model \(LlamaForCausalLM\), not a drafter.*as the target"):
        spec_decode.load_drafter(tmp_path / "t", target)
    with pytest.raises(ValueError, match="not a model directory"):
        check_target_dir(tmp_path / "nowhere")
