"""The real drafter's training script survives interruption: a run killed at a random moment and
resumed ends bit-exactly where an uninterrupted run ends; the schedule set once is kept across
resumes; the small committed state resumes the step, the schedule and the data order. Tiny random
target and feature caches in the script's own formats (the real target is not needed)."""

import base64
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fold.demo import corpus, tokens

from examples import train_real_drafter

VOCAB, SEQ, TAPS, HIDDEN = 120, 48, [1, 2], 32


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny Llama target in the converted-target layout, one feature cache of form ``code``, a stdlib."""
    root = tmp_path_factory.mktemp("real-training")
    stdlib = root / "stdlib"
    stdlib.mkdir()
    for name in ("alpha", "beta"):
        (stdlib / f"{name}.py").write_text("".join(f"def {name}_{i}(x):\n    return x + {i}\n" for i in range(150)))
    for pkg in corpus.HELD_OUT:
        (stdlib / pkg).mkdir()
        (stdlib / pkg / "__init__.py").write_text("".join(f"{pkg}_{i} = {i}\n" for i in range(50)))
    code, _ = corpus.split_corpus(stdlib)
    target_dir = root / "target"
    tokens.save_tokenizer(tokens.train_tokenizer([code], VOCAB), target_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(target_dir)
    (target_dir / "DONE").write_text("ok\n")
    cache = root / "features-code"
    cache.mkdir()
    g = torch.Generator().manual_seed(1)
    for index in range(2):
        ids = torch.randint(0, len(tokenizer), (8, SEQ), generator=g)
        save_file(dict(ids=ids.to(torch.int32), greedy=torch.roll(ids, -1, 1).to(torch.int32),
                       features=torch.randn(8, SEQ, len(TAPS) * HIDDEN, generator=g).to(torch.bfloat16),
                       copy=(torch.rand(8, SEQ, generator=g) < 0.3).to(torch.uint8)),
                  str(train_real_drafter.shard_path(cache, index)))
    (cache / "meta.json").write_text(json.dumps(dict(form="code", taps=TAPS, seq_len=SEQ, log=[])))
    return dict(stdlib=stdlib, target=target_dir, cache=cache, vocab=len(tokenizer))


def argv(run, out: Path, total: int, *extra: str) -> list[str]:
    return ["train", "--cache", str(run["cache"]), "--out", str(out), "--target", str(run["target"]),
            "--stdlib", str(run["stdlib"]), "--batch", "2", "--blocks", "3", "--block-size", "4", "--layers", "1",
            "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--negatives", "8", "--eval-prompts", "0",
            "--mask-token-id", str(run["vocab"] - 1), "--warmup", "5", "--total-steps", str(total),
            "--save-minutes", "1e-9", "--threads", "1", *extra]


def run_in_process(args: list[str]) -> dict:
    threads = torch.get_num_threads()
    try:
        return train_real_drafter.main(args)
    finally:
        torch.set_num_threads(threads)


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)


def assert_same_training_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["schedule"] == b["schedule"] and a["rewarm"] == b["rewarm"]
    assert a["rng"] == b["rng"] and torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for (i, sa), (j, sb) in zip(a["opt"]["state"].items(), b["opt"]["state"].items()):
        assert i == j and sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (i, k)


def test_resume_after_a_kill_at_a_random_moment_is_bit_exact(tiny_run, tmp_path):
    total = 150
    run_in_process(argv(tiny_run, tmp_path / "whole", total))
    whole = checkpoint(tmp_path / "whole")
    assert whole["step"] == total
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]))
    # A kill anywhere in the training, a checkpoint write included. A fast machine can finish all
    # the steps inside the drawn delay (the process then still lives, loading the drafter back):
    # such a draw is not a mid-run kill, so draw again from a shorter span.
    span, killed_at = 1.0, None
    for attempt in range(8):
        out = tmp_path / f"killed-{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "examples.train_real_drafter", *argv(tiny_run, out, total)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while not (out / "checkpoint.pt").is_file() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(random.Random().uniform(0.0, span))
            alive = proc.poll() is None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            proc.kill()
        assert (out / "checkpoint.pt").is_file(), f"no checkpoint was written: {proc.stderr.read().decode()[-2000:]}"
        killed_at = checkpoint(out)["step"]
        if alive and killed_at < total:
            break
        span /= 2
    assert killed_at is not None and killed_at < total, "every kill landed after the last step"
    run_in_process(argv(tiny_run, out, total))                 # the same command resumes
    assert_same_training_state(checkpoint(out), whole)
    steps = [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == total  # records past the checkpoint were dropped, once
    want = [json.loads(line)["step"] for line in (tmp_path / "whole" / "steps.jsonl").read_text().splitlines()]
    assert steps == want


def test_schedule_is_set_once_and_kept_across_resumes(tiny_run, tmp_path):
    out = tmp_path / "run"
    run_in_process(argv(tiny_run, out, 20, "--sitting-steps", "3"))        # a sitting of 3 steps
    first = checkpoint(out)
    assert first["step"] == 3 and first["schedule"]["total"] == 20
    # a later sitting with other schedule options keeps the run's schedule
    run_in_process(argv(tiny_run, out, 500, "--lr", "0.5", "--warmup", "99"))
    ckpt = checkpoint(out)
    assert ckpt["step"] == 20 and ckpt["schedule"] == first["schedule"]
    # --new-schedule starts one from the step resumed at; the log keeps every schedule set
    run_in_process(argv(tiny_run, out, 24, "--new-schedule", "--lr", "1e-3"))
    ckpt = checkpoint(out)
    assert ckpt["step"] == 24 and ckpt["schedule"] == dict(lr=1e-3, min_lr=0.1, warmup=5, start=20, total=24)
    assert ckpt["log"]["schedules"] == [ckpt["schedule"]]


def test_lr_schedule_warms_up_decays_and_rewarms():
    s = train_real_drafter.Schedule(lr=1.0, min_lr=0.1, warmup=10, start=100, total=300)

    def cosine(step):
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 100) / 200))

    assert s.at(100) == pytest.approx(0.1 * cosine(100)) and s.at(104) == pytest.approx(0.5 * cosine(104))
    assert s.at(109) == pytest.approx(cosine(109)) and s.at(200) == pytest.approx(0.55)
    assert s.at(300) == pytest.approx(0.1) and s.at(400) == pytest.approx(0.1)
    assert s.at(200, rewarm=200) == pytest.approx(0.055) and s.at(209, rewarm=200) == pytest.approx(s.at(209))


def test_committed_state_resumes_step_schedule_and_data_order(tiny_run, tmp_path, plain_mode):
    """Without OUT/checkpoint.pt, ``--state`` resumes the bf16 weights, step, schedule and RNGs, with new
    optimizer moments that warm up again; the data order continues where it stopped."""
    state = tmp_path / "state"
    run_in_process(argv(tiny_run, tmp_path / "a", 8, "--state", str(state)))
    saved = json.loads((state / "state.json").read_text())
    assert saved["step"] == 8 and saved["schedule"]["total"] == 8
    assert (state / "model.safetensors").stat().st_size < (tmp_path / "a" / "checkpoint.pt").stat().st_size
    exact = checkpoint(tmp_path / "a")
    # another machine: no checkpoint, the committed state and a new schedule
    shutil.copytree(state, tmp_path / "state-b")
    run_in_process(argv(tiny_run, tmp_path / "b", 10, "--state", str(tmp_path / "state-b"), "--new-schedule"))
    resumed = checkpoint(tmp_path / "b")
    assert resumed["step"] == 10 and resumed["rewarm"] == 8 and resumed["schedule"]["start"] == 8
    # what it resumed from is the exact run's end: its weights (rounded to bf16) and both RNGs
    weights = load_file(str(state / "model.safetensors"))
    assert weights.keys() == exact["model"].keys()
    for k, v in exact["model"].items():
        assert torch.equal(weights[k], v.to(torch.bfloat16)), k
    version, internal, gauss = saved["python_rng"]
    assert (version, tuple(internal), gauss) == exact["rng"]
    torch_rng = torch.frombuffer(bytearray(base64.b64decode(saved["torch_rng"])), dtype=torch.uint8)
    assert torch.equal(torch_rng, exact["torch_rng"])
    assert (state / "steps.jsonl").read_text() == (tmp_path / "a" / "steps.jsonl").read_text()
    # the step records travel with the state: b's log (and the state it writes) continues a's
    steps = [json.loads(line)["step"] for line in (tmp_path / "state-b" / "steps.jsonl").read_text().splitlines()]
    assert steps == [1, 10]
    # every file a run writes has a plain file's mode (safetensors alone gives 0600)
    for path in sorted((tmp_path / "b").iterdir()) + sorted((tmp_path / "state-b").iterdir()):
        assert path.stat().st_mode & 0o777 == plain_mode, path


def test_training_through_folds_read_draws_the_same_batches_and_learns_otherwise(tiny_run, tmp_path, capsys):
    """``--fold-window W``: the same batches (the RNGs end where the plain run's end), other weights (the
    read is FOLD's, tested against fold.attention in test_demo_training); a bad ``--fold-alpha`` is refused."""
    run_in_process(argv(tiny_run, tmp_path / "plain", 10, "--sitting-steps", "3"))
    run_in_process(argv(tiny_run, tmp_path / "fold", 10, "--sitting-steps", "3", "--fold-window", "4"))
    plain, folded = checkpoint(tmp_path / "plain"), checkpoint(tmp_path / "fold")
    assert plain["step"] == folded["step"] == 3
    assert plain["rng"] == folded["rng"] and torch.equal(plain["torch_rng"], folded["torch_rng"])
    assert any(not torch.equal(plain["model"][k], folded["model"][k]) for k in plain["model"])
    sitting = json.loads((tmp_path / "fold" / "train_log.json").read_text())["sittings"][-1]
    assert sitting["args"]["fold_window"] == "4" and sitting["args"]["fold_alpha"] == "2.0"
    assert sitting["draws_per_sequence"] == round(3 * 2 / 16, 3)           # 3 steps of 2 rows over 16 sequences
    with pytest.raises(SystemExit):
        train_real_drafter.main(argv(tiny_run, tmp_path / "bad", 10, "--fold-window", "4", "--fold-alpha", "0.5"))
    assert "--fold-alpha must be a float >= 1, got 0.5" in capsys.readouterr().err


def test_a_share_of_steps_through_folds_read_is_those_steps_resumed_with_and_without_it(tiny_run, tmp_path, capsys):
    """``--fold-share 0.5``: steps 0 and 2 read at true positions, steps 1 and 3 through FOLD's read, by
    the step number alone. Four steps in one run end bit-exactly where four one-step sittings end that
    alternate a plain sitting and a ``--fold-window`` sitting (the exact resume joins them); a share
    outside (0, 1] or without ``--fold-window`` is refused."""
    share = ("--fold-window", "4", "--fold-share", "0.5")
    assert [train_real_drafter.folded_step(k, train_real_drafter.parse_args(argv(tiny_run, tmp_path, 10, *share)))
            for k in range(6)] == [False, True, False, True, False, True]
    quarter = train_real_drafter.parse_args(argv(tiny_run, tmp_path, 10, "--fold-window", "4", "--fold-share", "0.25"))
    assert sum(train_real_drafter.folded_step(k, quarter) for k in range(400)) == 100
    run_in_process(argv(tiny_run, tmp_path / "mixed", 10, "--sitting-steps", "4", *share))
    for k in range(4):
        run_in_process(argv(tiny_run, tmp_path / "joined", 10, "--sitting-steps", "1",
                            *(("--fold-window", "4") if k % 2 else ())))
    run_in_process(argv(tiny_run, tmp_path / "plain", 10, "--sitting-steps", "4"))
    mixed, joined, plain = (checkpoint(tmp_path / name) for name in ("mixed", "joined", "plain"))
    assert_same_training_state(mixed, joined)
    assert mixed["rng"] == plain["rng"] and torch.equal(mixed["torch_rng"], plain["torch_rng"])
    assert any(not torch.equal(plain["model"][k], mixed["model"][k]) for k in plain["model"])
    refused = ((("--fold-window", "4", "--fold-share", "0"), "--fold-share must be a float in (0, 1], got 0.0"),
               (("--fold-share", "0.5"), "--fold-share 0.5 needs --fold-window"))
    for bad, message in refused:
        with pytest.raises(SystemExit):
            train_real_drafter.main(argv(tiny_run, tmp_path / "bad", 10, *bad))
        assert message in capsys.readouterr().err


def test_init_layers_copies_the_targets_layers_and_the_context_path(tiny_run, tmp_path, capsys):
    """``--init-layers``: drafter layer i starts as target layer ids[i]; the context the drafter's layers
    read is exactly what that first target layer reads (its input norm of the tap below it); bad
    geometry, ids out of range, a count that is not the drafter's layers or --resume-from are refused."""
    from fold.spec_decode.drafter import Drafter
    from fold.spec_decode.loading import read_config

    target = transformers.LlamaForCausalLM.from_pretrained(tiny_run["target"]).eval()

    def drafter_for(*extra):
        args = train_real_drafter.parse_args(argv(tiny_run, tmp_path / "out", 10, *extra))
        args.seq_len = SEQ
        folder = tmp_path / "cfg"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(train_real_drafter.drafter_config(target.config, TAPS, args)))
        return Drafter(read_config(folder, target.config))

    drafter = drafter_for("--init-layers", "3")
    train_real_drafter.init_from_target(drafter, target, [3], TAPS)
    theirs = dict(target.model.layers[3].named_parameters())
    for name, p in drafter.layers[0].named_parameters():
        if name in theirs:
            assert torch.equal(p, theirs[name]), name
    assert {n for n, _ in drafter.layers[0].named_parameters()} - set(theirs) == {"self_attn.q_norm.weight",
                                                                                 "self_attn.k_norm.weight"}
    features = torch.randn(1, 5, len(TAPS) * HIDDEN)
    with torch.no_grad():
        h = target.model.layers[3].input_layernorm(features[..., HIDDEN:])      # tap 2 = layer 3's input
        torch.testing.assert_close(drafter.hidden_norm(drafter.fc(features)), h, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        train_real_drafter.init_from_target(drafter_for("--intermediate", "16"), target, [3], TAPS)
    with pytest.raises(ValueError, match=r"\[4\] out of range"):
        train_real_drafter.init_from_target(drafter_for(), target, [4], TAPS)
    with pytest.raises(ValueError, match="input is tap 0, which the drafter does not read"):
        train_real_drafter.init_from_target(drafter_for(), target, [1], TAPS)
    for extra in (["--init-layers", "2", "3"], ["--init-layers", "3", "--resume-from", str(tmp_path)]):
        with pytest.raises(SystemExit):
            train_real_drafter.parse_args(argv(tiny_run, tmp_path / "x", 10, *extra))
        assert "--init-layers starts a fresh run" in capsys.readouterr().err
    run_in_process(argv(tiny_run, tmp_path / "init", 10, "--init-layers", "3", "--sitting-steps", "1"))
    assert json.loads((tmp_path / "init" / "train_log.json").read_text())["sittings"][-1]["args"]["init_layers"] == "[3]"
