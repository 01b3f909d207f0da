"""fold.vllm's config block and configure(): no vLLM needed (the engine tests live in tests/vllm)."""

import json

import pytest

from fold.vllm import ServeRead, configure, parse_block


@pytest.mark.parametrize("block, want", [
    (None, ServeRead()),
    ({"read": "stock"}, ServeRead()),
    ({"read": "fold", "window": 2048}, ServeRead("fold", 2048, 2.0)),
    ({"read": "fold", "window": 0, "alpha": 4}, ServeRead("fold", 0, 4.0)),
    ({"read": "window", "window": 16}, ServeRead("window", 16, 1.0)),
    ({"read": "rerope", "window": 16, "training_length": 512}, ServeRead("rerope", 16, 1.0, 512)),
])
def test_blocks_parse(block, want):
    got = parse_block(block)
    assert got == want and got.active == (want.read != "stock")


@pytest.mark.parametrize("block, words", [
    ([1], "the drafter config's 'fold' block must be an object"),
    ({"window": 8}, "fold.read must be one of"),
    ({"read": "fold"}, "fold.window must be an integer >= 0"),
    ({"read": "fold", "window": 8.0}, "fold.window must be an integer >= 0"),
    ({"read": "fold", "window": True}, "fold.window must be an integer >= 0"),
    ({"read": "fold", "window": 8, "alpha": 0.9}, "fold.alpha must be a number in [1, 10000]"),
    ({"read": "fold", "window": 8, "alpha": float("nan")}, "fold.alpha must be a number in [1, 10000]"),
    ({"read": "window", "window": 8, "alpha": 2}, "fold.alpha is not a field of read='window'"),
    ({"read": "stock", "window": 8}, "fold.window is not a field of read='stock'"),
    ({"read": "rerope", "window": 8, "training_length": 1}, "fold.training_length must be an integer >= 2"),
])
def test_bad_blocks_name_the_field(block, words):
    with pytest.raises(ValueError) as info:
        parse_block(block)
    assert words in str(info.value)


def test_configure_writes_a_linked_copy(tmp_path):
    src = tmp_path / "drafter"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "hidden_size": 8}))
    (src / "model.safetensors").write_bytes(b"weights")
    out = configure(src, tmp_path / "drafter-fold", read="fold", window=64, alpha=3.0)
    config = json.loads((out / "config.json").read_text())
    assert config == {"architectures": ["DFlashDraftModel"], "hidden_size": 8,
                      "fold": {"read": "fold", "window": 64, "alpha": 3.0}}
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert "fold" not in json.loads((src / "config.json").read_text())            # the source is untouched
    with pytest.raises(ValueError, match="fold.window must be an integer >= 0"):
        configure(src, tmp_path / "bad", read="fold", window=-1)
    assert not (tmp_path / "bad").exists()                                         # refused before writing
    with pytest.raises(ValueError, match="drafter_dir must hold a config.json"):
        configure(tmp_path / "nowhere", tmp_path / "x")
