"""The shipped demo pair (through the public loading path) and a reduced ``fold-demo`` run."""

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

import fold.demo
from fold import spec
from fold.demo import cli, data
from fold.spec.policies import BUILT
from reference import rope_attention_ref
from reference.tolerance import check_close
from tests.spec_fixtures import greedy_ar, padded_batch

pytestmark = pytest.mark.skipif(not (fold.demo.DRAFTER_DIR / "model.safetensors").is_file(),
                                reason="demo artifacts not trained yet")


@pytest.fixture(scope="module")
def pair():
    target = transformers.AutoModelForCausalLM.from_pretrained(fold.demo.TARGET_DIR, dtype=torch.float32).eval()
    return target, spec.load_drafter(fold.demo.DRAFTER_DIR, target), spec.load_drafter(fold.demo.ANCHOR_DRAFTER_DIR,
                                                                                         target)


def test_shipped_artifacts_are_small_and_in_real_formats():
    total = sum(f.stat().st_size for f in fold.demo.ARTIFACTS.rglob("*") if f.is_file())
    assert total <= 25 * 2**20, f"shipped artifacts take {total / 2**20:.1f} MiB"
    for d in (fold.demo.DRAFTER_DIR, fold.demo.ANCHOR_DRAFTER_DIR):
        config = json.loads((d / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and "dflash_config" in config
    assert json.loads((fold.demo.TARGET_DIR / "config.json").read_text())["model_type"] \
        == "fold_toy"


@pytest.mark.parametrize("policy", BUILT)
def test_shipped_pair_is_lossless_on_every_policy(pair, policy):
    target, drafter, _ = pair
    rng = random.Random(7)
    held = data.held_out_code()
    prompts = [torch.tensor(list(data.code_prompt(held, rng, 700))),
               torch.tensor(list(data.retrieval_prompt(rng, 900, 400)))]
    ids, mask = padded_batch(prompts)
    opts = cli.policy_options(policy, window=64, alpha=2.0, train_len=256)     # long-context paths at ~800 bytes
    out = spec.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=20, policy=policy, **opts)
    for b, p in enumerate(prompts):
        expected = greedy_ar(target, p, 20)
        assert torch.equal(out.sequences[b, :len(expected)], expected), f"row {b} differs from the target's greedy"


def test_anchor_offset_drafter_is_lossless(pair):
    target, _, anchor = pair
    prompt = torch.tensor(list(data.retrieval_prompt(random.Random(1), 1200, 600)))
    out = spec.generate(target, anchor, prompt[None], max_new_tokens=24, policy="dflash")
    assert torch.equal(out.sequences[0], greedy_ar(target, prompt, 24))


def test_shipped_drafter_drafts_better_than_chance(pair):
    target, drafter, _ = pair
    prompt = torch.tensor(list(data.code_prompt(data.held_out_code(), random.Random(2), 600)))
    out = spec.generate(target, drafter, prompt[None], max_new_tokens=48, policy="dflash")
    assert out.tau > 1.5          # a drafter that never agrees with the target gives exactly 1


def test_tree_verification_is_refused_for_the_toy_target(pair):
    target, drafter, _ = pair
    with pytest.raises(ValueError, match="AttentionInterface"):
        spec.generate(target, drafter, torch.tensor([list(b"def f(x):\n")]), max_new_tokens=4, tree=(2, 2))


def test_reduced_demo_runs_and_reports(tmp_path, capsys):
    code = cli.main(["--lengths", "1024", "--rows", "dflash", "fold", "--prompts", "2", "--new-tokens", "12",
                     "--window", "128", "--out", str(tmp_path), "--no-progress", "--shift"])
    assert code == 0
    records = json.loads((tmp_path / "results.json").read_text())
    keys = {"task", "length", "policy", "tau", "tau_ci", "speedup", "speedup_ci", "lossless"}
    assert all(keys <= set(r) for r in records)
    assert {(r["task"], r["policy"]) for r in records if r["task"] != "shift"} == {
        (t, p) for t in ("code", "retrieval") for p in ("AR", "dflash", "fold")}
    shifted = [r for r in records if r["task"] == "shift"]
    assert {(r["policy"], r["shift"]) for r in shifted} == {(p, s) for p in ("dflash", cli.ANCHOR_ROW)
                                                            for s in cli.SHIFTS}
    assert all(r["lossless"] for r in records)
    assert all(r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1] for r in records)
    assert (tmp_path / "tau_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"lossless: {4 + len(shifted)}/{4 + len(shifted)} runs" in printed and "retrieval" in printed


def test_shift_read_at_zero_equals_the_plain_read(pair):
    _, drafter, _ = pair
    rope = drafter.cfg.rope
    torch.manual_seed(0)
    q = torch.randn(1, 8, 4, 64)
    k, v = torch.randn(1, 40, 2, 64), torch.randn(1, 40, 2, 64)
    truth, _ = rope_attention_ref(q, k, v, rope=rope)
    same_dtype, _ = rope_attention_ref(q, k, v, rope=rope, upcast=False)
    check_close("shift 0 vs plain read", cli.shifted_read(rope, 0)(q, k, v, 0), truth, same_dtype, torch.float32)
    plain = fold.attention(q, k, v, window=40, rope=rope, backend="torch")
    assert not torch.allclose(cli.shifted_read(rope, 4096)(q, k, v, 0), plain, atol=1e-3)


@pytest.mark.parametrize("args, words", [
    (["--prompts", "0"], "--prompts: must be >= 1, got 0"),
    (["--new-tokens", "0"], "--new-tokens: must be >= 1, got 0"),
    (["--lengths", "1024", "0"], "--lengths: must be >= 256, got 0"),
    (["--window", "-1"], "--window: must be >= 8"),
    (["--alpha", "0.5"], "--alpha: must lie in [1, 10000], got 0.5"),
    (["--alpha", "x"], "--alpha: expected a number"),
])
def test_demo_rejects_bad_options_before_any_work(args, words, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "load_pair", lambda: pytest.fail("the pair must not load for bad options"))
    with pytest.raises(SystemExit) as info:
        cli.main(args + ["--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_demo_checks_out_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_pair", lambda: pytest.fail("the pair must not load for a bad --out"))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as info:
        cli.main(["--out", str(blocker / "sub"), "--no-progress"])
    assert info.value.code == 2 and "is not a writable folder" in capsys.readouterr().err


def test_results_are_written_table_first_and_atomically(tmp_path, monkeypatch):
    """results.json appears only after table.txt (and the plot) of the same records; a failing write
    leaves neither a partial file nor a stale temporary behind."""
    records = [dict(task="code", length=1024, policy=p, tau=t, tau_ci=[t - 0.1, t + 0.1], speedup=1.0,
                    speedup_ci=[0.9, 1.1], lossless=True) for p, t in (("AR", 1.0), ("fold", 2.0))]
    order = []
    real_replace = cli.os.replace
    monkeypatch.setattr(cli.os, "replace", lambda a, b: (order.append(Path(b).name), real_replace(a, b)))
    cli.save_results(records, tmp_path)
    assert order == ["tau_vs_length.png", "table.txt", "results.json"]
    assert json.loads((tmp_path / "results.json").read_text()) == records

    def broken(path):
        path.write_text("half")
        raise OSError("disk full")
    monkeypatch.setattr(cli, "format_table", lambda records: "new table")
    monkeypatch.setattr(cli, "plot", lambda records, path: broken(path))
    with pytest.raises(OSError, match="disk full"):
        cli.save_results(records[:1], tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == records      # the old, complete results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "table.txt", "tau_vs_length.png"]
