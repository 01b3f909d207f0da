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
    ({"read": "fold", "window": 16, "backend": "triton"}, ServeRead("fold", 16, 2.0, backend="triton")),
    ({"read": "window", "window": 16, "backend": "torch"}, ServeRead("window", 16, 1.0, backend="torch")),
    ({"read": "fold", "window": 16, "far_budget": 1024}, ServeRead("fold", 16, 2.0, far_budget=1024)),
    ({"read": "fold", "window": 16, "far_budget": 64, "far_page": 16},
     ServeRead("fold", 16, 2.0, far_budget=64, far_page=16)),
    ({"read": "fold", "window": 16, "far_budget": 64, "far_rank": "keys"},
     ServeRead("fold", 16, 2.0, far_budget=64, far_rank="keys")),
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
    ({"read": "fold", "window": 8, "backend": "cuda"}, "fold.backend must be one of ('auto', 'torch', 'triton')"),
    ({"read": "stock", "backend": "torch"}, "fold.backend is not a field of read='stock'"),
    ({"read": "fold", "window": 8, "far_budget": 0}, "fold.far_budget must be an integer >= 1, got 0"),
    ({"read": "fold", "window": 8, "far_budget": 64.0}, "fold.far_budget must be an integer >= 1, got 64.0"),
    ({"read": "fold", "window": 8, "far_budget": True}, "fold.far_budget must be an integer >= 1, got True"),
    ({"read": "fold", "window": 8, "far_budget": 64, "far_page": 0}, "fold.far_page must be an integer >= 1"),
    ({"read": "fold", "window": 8, "far_page": 16}, "fold.far_page sizes the pages of far_budget"),
    ({"read": "fold", "window": 8, "far_budget": 64, "far_rank": "box"},
     "fold.far_rank must be one of ('bound', 'keys'), got 'box'"),
    ({"read": "fold", "window": 8, "far_rank": "keys"}, "fold.far_rank ranks the pages of far_budget"),
    ({"read": "window", "window": 8, "far_budget": 64}, "fold.far_budget is not a field of read='window'"),
    ({"read": "rerope", "window": 8, "far_budget": 64}, "fold.far_budget is not a field of read='rerope'"),
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


def _drafter(tmp_path, **config):
    src = tmp_path / "drafter"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], **config}))
    return src


def test_configure_says_what_vllm_does_past_the_drafters_length_and_raises_it_when_asked(tmp_path):
    src = _drafter(tmp_path, max_position_embeddings=4096, rope_parameters={"rope_type": "default"})
    with pytest.warns(UserWarning, match="past position 4096 vLLM drafts nothing for the whole batch"):
        out = configure(src, tmp_path / "a", read="fold", window=64, max_model_len=32768)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 4096
    out = configure(src, tmp_path / "b", read="fold", window=64, max_model_len=32768, raise_max_position=True)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 32768
    assert json.loads((src / "config.json").read_text())["max_position_embeddings"] == 4096
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure(src, tmp_path / "c", read="fold", window=64, max_model_len=4096)    # fits: no warning
    with pytest.raises(ValueError, match="raise_max_position needs max_model_len"):
        configure(src, tmp_path / "d", read="fold", window=64, raise_max_position=True)
    with pytest.raises(ValueError, match="max_model_len must be a positive int"):
        configure(src, tmp_path / "e", read="fold", window=64, max_model_len=0)


def test_raising_the_length_of_a_dynamic_ntk_drafter_is_refused(tmp_path):
    """vLLM forms dynamic NTK frequencies from max_position_embeddings: raising it would move them."""
    src = _drafter(tmp_path, max_position_embeddings=4096, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic NTK RoPE"):
        configure(src, tmp_path / "a", read="fold", window=64, max_model_len=32768, raise_max_position=True)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("read, block_size, n_q, words", [
    (ServeRead("fold", 8, 2.0, far_budget=64, far_page=32), 16, 8,
     "fold.far_page must equal the drafter cache's block size 16 (its pages are the far pages), got 32"),
    (ServeRead("fold", 8, 2.0, far_budget=16), 16, 8,         # 8 rows can straddle 2 pages of 16
     "fold.far_budget must hold at least 2 pages of 16 entries for a draft block of 8 rows"),
    (ServeRead("fold", 8, 2.0, far_budget=40), 16, 20, "at least 3 pages of 16 entries"),
])
def test_far_pages_are_checked_against_the_cache(read, block_size, n_q, words):
    with pytest.raises(ValueError) as info:
        read.check_pages(block_size, n_q)
    assert words in str(info.value)


def test_far_pages_that_fit_the_cache_pass():
    ServeRead("fold", 8, 2.0, far_budget=32).check_pages(16, 8)                  # far_page: the block size
    ServeRead("fold", 8, 2.0, far_budget=32, far_page=16).check_pages(16, 17)
    ServeRead("fold", 8, 2.0).check_pages(16, 64)                                  # no budget: nothing to check


def test_configure_writes_the_far_budget(tmp_path):
    src = tmp_path / "drafter"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    out = configure(src, tmp_path / "drafter-budget", read="fold", window=64, far_budget=1024, far_page=16,
                    far_rank="keys")
    assert json.loads((out / "config.json").read_text())["fold"] == {"read": "fold", "window": 64, "far_budget": 1024,
                                                                     "far_page": 16, "far_rank": "keys"}
    with pytest.raises(ValueError, match="fold.far_budget must be an integer >= 1"):
        configure(src, tmp_path / "bad", read="fold", window=64, far_budget=-1)
