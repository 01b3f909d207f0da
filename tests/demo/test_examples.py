"""The example scripts run end to end on tiny local checkpoints."""

import sys
from pathlib import Path

import pytest

from tests.spec_decode_fixtures import VOCAB, make_drafter, make_target



def _save_word_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w95").save_pretrained(path)


def test_generate_example_is_lossless_against_ar(tmp_path, capsys):
    from examples import generate

    target = make_target("qwen3", tmp_path / "target")
    _save_word_tokenizer(tmp_path / "target")
    make_drafter(tmp_path / "drafter", target, "zlab")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{(7 * i) % 90}" for i in range(40)))
    generate.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--policy", "fold",
                   "--prompt-file", str(prompt), "--max-new-tokens", "12", "--window", "8", "--dtype", "float32",
                   "--compare-ar"])
    out = capsys.readouterr().out
    assert "policy fold: tau" in out and "identical output: True" in out


def test_fold_vs_attention_example_runs(capsys):
    from examples import fold_vs_attention

    fold_vs_attention.main(["--lengths", "600", "--repeats", "1", "--drafter", "qwen3-8b-b7", "--keys-rotated"])
    out = capsys.readouterr().out
    assert "FOLD/packed" in out and "FOLD/gqa" in out and "     600 " in out


@pytest.mark.parametrize("args, words", [(["--repeats", "0"], "--repeats: must be >= 1"),
                                         (["--lengths", "5"], "--lengths must be >= the block's n_q=10"),
                                         (["--alpha", "0.5"], "--alpha must lie in [1, 10000]")])
def test_fold_vs_attention_rejects_bad_options(args, words, capsys):
    from examples import fold_vs_attention

    with pytest.raises(SystemExit):
        fold_vs_attention.main(args)
    assert words in capsys.readouterr().err


def test_generate_example_runs_on_the_shipped_pair_with_its_tokenizer(tmp_path, capsys):
    import fold.demo
    from examples import generate

    prompt = tmp_path / "prompt.py"
    prompt.write_text((Path(generate.__file__)).read_text()[:700])
    assert generate.main(["--target", str(fold.demo.TARGET_DIR), "--drafter", str(fold.demo.DRAFTER_DIR),
                          "--prompt-file", str(prompt), "--max-new-tokens", "16", "--window", "64",
                          "--dtype", "float32", "--compare-ar"]) == 0
    out = capsys.readouterr().out
    n_tokens = int(out.split("prompt: ")[1].split(" tokens")[0])
    assert 100 < n_tokens < 700, n_tokens          # the target directory's BPE tokenizer, not bytes
    assert "identical output: True" in out


def _target_without_tokenizer(tmp_path):
    import shutil

    import fold.demo

    bare = tmp_path / "bare_target"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(fold.demo.TARGET_DIR / name, bare / name)
    return bare


@pytest.mark.parametrize("extra, words", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["--window", "-5"], "--window: must be >= 0"),
    (["--alpha", "0.5"], "alpha must be finite and in [1, 10000]"),
    (["--temperature", "-1"], "--temperature: must be a finite number >= 0"),
    (["--tokenizer", "hf"], "has no tokenizer files; pass --tokenizer bytes"),
])
def test_generate_example_rejects_bad_options(tmp_path, capsys, extra, words):
    """A usage error (argparse's exit 2) or, for what only the library checks, one line and exit code 2."""
    import fold.demo
    from examples import generate

    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):\n")
    target = _target_without_tokenizer(tmp_path) if "--tokenizer" in extra else fold.demo.TARGET_DIR
    try:
        code = generate.main(["--target", str(target), "--drafter", str(fold.demo.DRAFTER_DIR),
                              "--prompt-file", str(prompt), "--dtype", "float32"] + extra)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


def test_generate_example_rejects_missing_files(tmp_path, capsys):
    import fold.demo
    from examples import generate

    (tmp_path / "empty.txt").write_text("  \n")
    for args, words in ((["--prompt-file", str(tmp_path / "none.txt")], "does not exist"),
                        (["--prompt-file", str(tmp_path / "empty.txt")], "is empty")):
        with pytest.raises(SystemExit):
            generate.main(["--target", str(fold.demo.TARGET_DIR), "--drafter", str(fold.demo.DRAFTER_DIR)] + args)
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--target", str(tmp_path), "--drafter", str(fold.demo.DRAFTER_DIR),
                       "--prompt-file", str(tmp_path / "empty.txt")])
    assert "is not a model directory" in capsys.readouterr().err


def test_engine_cache_example_matches_the_reference(capsys):
    from examples import engine_cache

    assert engine_cache.main(["--lengths", "300", "9", "--page-size", "7", "--window", "32", "--n-q", "4",
                              "--head-dim", "32"]) == 0
    assert "every request matches the dense reference" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        engine_cache.main(["--heads", "6", "4"])
    assert "must be a multiple of HKV=4" in capsys.readouterr().err


def test_generate_example_prints_a_usage_error_before_importing_torch(tmp_path):
    """The CLI parses its arguments first: a usage error needs none of torch, transformers or fold."""
    import subprocess

    script = ("import runpy, sys\nsys.argv = ['generate.py', '--policy', 'fold']\n"
              "try:\n    runpy.run_path(%r, run_name='__main__')\n"
              "except SystemExit as e:\n    print('exit', e.code)\n"
              "print('heavy', sorted(m for m in ('torch', 'transformers', 'fold') if m in sys.modules))\n"
              % str(Path(__file__).resolve().parents[2] / "examples" / "generate.py"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "the following arguments are required: --target, --drafter, --prompt-file" in done.stderr
    assert done.stdout.splitlines() == ["exit 2", "heavy []"]


def test_generate_example_names_a_swapped_pair_without_a_traceback(tmp_path, capsys):
    from examples import generate

    target = make_target("qwen3", tmp_path / "target")
    make_drafter(tmp_path / "drafter", target, "zlab")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w1 w2 w3")
    common = ["--prompt-file", str(prompt), "--dtype", "float32", "--tokenizer", "bytes"]
    assert generate.main(["--target", str(tmp_path / "drafter"), "--drafter", str(tmp_path / "target"), *common]) == 2
    err = capsys.readouterr().err
    assert "is a DFlash/DSpark drafter (DFlashDraftModel), not a target" in err and "Traceback" not in err
    assert generate.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "target"), *common]) == 2
    err = capsys.readouterr().err
    assert "is a target model (Qwen3ForCausalLM), not a drafter" in err and "pass this one as the target" in err


def test_generate_example_takes_a_window_of_zero_as_the_library_does(tmp_path):
    from examples import generate
    from fold import spec_decode

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w1 w2")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    args = generate.parse_args(["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "t"), "--prompt-file",
                                str(prompt), "--window", "0", "--tokenizer", "bytes"])
    assert args.window == 0
    assert set(generate.POLICY_OPTIONS) == set(spec_decode.POLICIES)
    with pytest.raises(SystemExit):
        generate.parse_args(["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "t"), "--prompt-file",
                             str(prompt), "--window", "-1"])
