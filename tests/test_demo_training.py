"""Smoke tests of the demo's training scripts (a few steps on tiny data) and of the toy target."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch
import transformers

import fold.demo
from fold.demo import FoldToyConfig, FoldToyForCausalLM, data
from fold.spec import load_drafter

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_drafter  # noqa: E402
import train_target  # noqa: E402


@pytest.fixture(scope="module")
def tiny_stdlib(tmp_path_factory):
    """A source tree shaped like the standard library: training modules and the held-out packages."""
    root = tmp_path_factory.mktemp("stdlib")
    rng = random.Random(0)
    for name in ("alpha", "beta", "gamma"):
        (root / f"{name}.py").write_text("".join(f"def {name}_{i}(x):\n    return x + {i}\n" for i in range(200)))
    for pkg in data.HELD_OUT:
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("".join(f"{pkg}_{rng.randint(0, 9)} = {i}\n" for i in range(300)))
    return root


def test_split_keeps_held_out_packages_out_of_training(tiny_stdlib):
    train, held = data.split_corpus(tiny_stdlib)
    assert set(held) == set(data.HELD_OUT)
    for pkg in data.HELD_OUT:
        assert f"# file: {pkg}/".encode() not in train and held[pkg].startswith(f"# file: {pkg}/".encode())
    assert b"# file: alpha.py" in train


def test_retrieval_prompt_asks_for_a_far_key():
    rng = random.Random(3)
    prompt = data.retrieval_prompt(rng, 4096, 2000)
    key = prompt.rsplit(b"\n", 1)[-1]
    assert key.endswith(b":") and abs(len(prompt) - 4096) < 64
    stored = prompt.index(b"\n" + key) + 1
    assert len(prompt) - stored >= 2000 and prompt.count(b"\n" + key) == 2      # stored once, then asked


def _tiny_target(path, seed=0):
    torch.manual_seed(seed)
    cfg = FoldToyConfig(hidden_size=32, intermediate_size=64, head_dim=8, sliding_window=16, conv_taps=4)
    model = FoldToyForCausalLM(cfg)
    model.model.layers[2].self_attn.induction_init(lags=2, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_toy_target_cache_matches_full_forward(tmp_path):
    target = _tiny_target(tmp_path / "t").double()     # chunked vs full forward: compare in float64
    ids = torch.randint(0, 256, (2, 90))
    with torch.no_grad():
        full = target(ids).logits
        out = target(ids[:, :40], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for t in range(40, 90, 7):
            parts.append(target(ids[:, t:t + 7], cache=cache, use_cache=True).logits)
        torch.testing.assert_close(torch.cat(parts, 1), full)
        cache.crop(-13)                                   # speculative rejection: drop the last entries
        again = target(ids[:, 77:90], cache=cache, use_cache=True).logits
        torch.testing.assert_close(again, full[:, 77:90])


def test_toy_target_reloads_exactly(tmp_path):
    # from_pretrained builds modules on the meta device: nothing the forward needs may be left out of the
    # checkpoint (a non-persistent RoPE buffer once came back as uninitialised memory)
    torch.manual_seed(0)
    model = FoldToyForCausalLM(FoldToyConfig(hidden_size=32, intermediate_size=64, head_dim=8, sliding_window=16))
    model.save_pretrained(tmp_path / "t")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 50))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_toy_target_refuses_padding(tmp_path):
    target = _tiny_target(tmp_path / "t")
    with pytest.raises(ValueError, match="attention_mask"):
        target(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1]]))


def test_induction_init_copies_a_repeated_sequence():
    torch.manual_seed(0)
    cfg = FoldToyConfig()
    attn = FoldToyForCausalLM(cfg).model.layers[2].self_attn
    attn.induction_init(generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 64, cfg.hidden_size)
    x = torch.cat([x, x], 1)                             # the second half repeats the first
    xi = torch.nn.functional.pad(x.transpose(1, 2), (cfg.conv_taps - 1, 0))
    q = attn.q_conv(xi).view(1, 4, 64, 128).transpose(2, 3)
    k = attn.k_conv(xi).view(1, 2, 64, 128).transpose(2, 3).repeat_interleave(2, 1)
    s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(128, 128).triu(1).bool(), float("-inf"))
    p = s.softmax(-1)[0]                                 # [heads, 128, 128]
    t = torch.arange(70, 128)
    assert p[:, t, t - 63].mean() > 0.9                  # attends to the entry after the earlier copy


def test_train_target_smoke(tiny_stdlib, tmp_path):
    log = train_target.main(["--out", str(tmp_path / "target"), "--max-steps", "3", "--minutes", "5",
                             "--seq-len", "64", "--batch", "2", "--hidden", "32", "--eval-lengths", "128",
                             "--stdlib", str(tiny_stdlib)])
    assert log["total_steps"] == 3 and all(s["loss"] == s["loss"] for s in log["steps"])   # no NaN
    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    assert isinstance(target, FoldToyForCausalLM) and target.dtype == torch.bfloat16
    assert json.loads((tmp_path / "target" / "train_log.json").read_text())["total_steps"] == 3


@pytest.mark.parametrize("anchor_offset", [False, True])
def test_train_drafter_smoke(tiny_stdlib, tmp_path, anchor_offset):
    _tiny_target(tmp_path / "target")
    out = tmp_path / "drafter"
    log = train_drafter.main(["--target", str(tmp_path / "target"), "--out", str(out), "--max-steps", "3",
                              "--seq-len", "64", "--batch", "2", "--blocks", "4", "--block-size", "4",
                              "--stdlib", str(tiny_stdlib), "--max-offset", "5000"]
                             + (["--anchor-offset"] if anchor_offset else []))
    assert log["total_steps"] == 3
    # the loaded module's inference path reproduces the training forward (bf16 weights, fp32 compute)
    assert log["load_check_max_abs_diff"] < 1e-3
    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32)
    drafter = load_drafter(out, target)
    assert drafter.cfg.block_size == 4 and drafter.cfg.target_layer_ids == [0, 1, 2]
    assert json.loads((out / "config.json").read_text())["fold_training"]["anchor_offset"] is anchor_offset


def test_anchor_offset_positions_keep_sinks():
    pos = train_drafter.sample_positions(random.Random(0), 3, 40, True, 4, 10_000)
    assert (pos[:, :4] == torch.arange(4)).all()
    assert ((pos[:, 5:] - pos[:, 4:-1]) == 1).all() and (pos[:, 4] >= 4).all()
    assert (train_drafter.sample_positions(random.Random(0), 2, 40, False, 4, 10_000) == torch.arange(40)).all()


def test_demo_module_paths():
    assert fold.demo.TARGET_DIR.parent == fold.demo.ARTIFACTS
