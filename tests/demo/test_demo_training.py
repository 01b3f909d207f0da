"""Smoke tests of the demo's training scripts (a few steps on tiny data), its data and the toy target."""

import copy
import json
import math
import random
import time

import pytest
import torch
import transformers

import fold.demo
from fold.demo import FoldToyConfig, FoldToyForCausalLM, corpus, documents, prompts, tokens
from fold.spec_decode import load_drafter
from reference.tolerance import check_close

from examples import drafter_init
from examples import train_drafter
from examples import train_target


@pytest.fixture(scope="module")
def tiny_stdlib(tmp_path_factory):
    """A source tree shaped like the standard library: training modules and the held-out packages."""
    root = tmp_path_factory.mktemp("stdlib")
    rng = random.Random(0)
    for name in ("alpha", "beta", "gamma"):
        (root / f"{name}.py").write_text("".join(f"def {name}_{i}(x):\n    return x + {i}\n" for i in range(200)))
    for pkg in corpus.HELD_OUT:
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("".join(f"{pkg}_{rng.randint(0, 9)} = {i}\n" for i in range(300)))
    return root


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_stdlib, tmp_path_factory):
    code, _ = corpus.split_corpus(tiny_stdlib)
    rng = random.Random(1)
    texts = [code] + [documents.training_text(rng, code, 2000, kind) for kind in ("kv", "lines", "strings")
                      for _ in range(3)]
    path = tmp_path_factory.mktemp("tok")
    tokens.save_tokenizer(tokens.train_tokenizer(texts, 400), path)
    return transformers.AutoTokenizer.from_pretrained(path)


def test_split_keeps_held_out_packages_out_of_training(tiny_stdlib):
    train, held = corpus.split_corpus(tiny_stdlib)
    assert set(held) == set(corpus.HELD_OUT)
    for pkg in corpus.HELD_OUT:
        assert f"# file: {pkg}/" not in train and held[pkg].startswith(f"# file: {pkg}/")
    assert "# file: alpha.py" in train


def test_tokenizer_loads_with_autotokenizer_and_round_trips(tiny_tokenizer):
    assert len(tiny_tokenizer) == 400
    assert tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer.mask_token_id) == tokens.MASK_TOKEN
    text = "def alpha_3(x):\n    return x + 3\nkey_12: 0f3a9c2e 77bd0a4c\n"
    ids = tokens.encode(tiny_tokenizer, text)
    assert tiny_tokenizer.decode(ids) == text and len(ids) < len(text)          # subwords, not bytes
    assert tokens.MASK_TOKEN not in tiny_tokenizer.decode(ids)


def test_retrieval_prompt_asks_for_a_far_key(tiny_tokenizer):
    prompt, answer = prompts.retrieval_prompt(random.Random(3), tiny_tokenizer, 600, 300)
    text = tiny_tokenizer.decode(prompt)
    key = text.rsplit("\n", 1)[-1]
    value = tiny_tokenizer.decode(answer)
    assert key.endswith(":") and 600 - 40 < len(prompt) <= 600
    assert text.count("\n" + key) == 2 and ("\n" + key + value + "\n") in text   # stored once, then asked
    stored = prompt.index(answer[0], 0)
    assert len(prompt) - stored >= 300 and len(value.split()) == 2


def test_copy_mask_marks_continuations_of_earlier_ngrams():
    ids = torch.tensor([[5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 9]])
    mask = tokens.copy_mask(ids, order=2)[0].tolist()
    # "5 6" is followed by 7 twice (position 7 is a copy); at position 11 it is followed by 9, not 7
    assert mask == [False] * 7 + [True] + [False] * 4


def test_copy_mask_longest_match_predicts_from_the_better_occurrence():
    # "8 1 2" is followed by 4, then "9 1 2" by 3; at the second "8 1 2" the latest "1 2" predicts 3, the
    # longest match ("8 1 2") predicts 4, which follows
    ids = torch.tensor([[8, 1, 2, 4, 0, 9, 1, 2, 3, 0, 8, 1, 2, 4]])
    assert tokens.copy_mask(ids)[0, 13].item() is False                     # latest "1 2" was followed by 3
    assert tokens.copy_mask(ids, max_order=4)[0, 13].item() is True         # "8 1 2" was followed by 4
    assert torch.equal(tokens.copy_mask(ids, max_order=2), tokens.copy_mask(ids))
    with pytest.raises(ValueError, match="max_order must be >= order=2"):
        tokens.copy_mask(ids, max_order=1)


def _tiny_target(path, seed=0, vocab=257, mask_token_id=256):
    torch.manual_seed(seed)
    cfg = FoldToyConfig(vocab_size=vocab, mask_token_id=mask_token_id, hidden_size=64, intermediate_size=64,
                        head_dim=16, sliding_window=16, conv_taps=4, channel_lags=3, channel_width=4)
    model = FoldToyForCausalLM(cfg)
    model.model.layers[2].self_attn.induction_init(lags=2, generator=torch.Generator().manual_seed(seed), copy_gain=2.0)
    model.init_context_channel(generator=torch.Generator().manual_seed(seed))
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


def test_context_channel_holds_the_previous_codes_and_no_layer_writes_it(tmp_path):
    target = _tiny_target(tmp_path / "t")
    cfg = target.config
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    table = target.model.embed_tokens.weight
    base, w = cfg.write_dims, cfg.channel_width
    for layer_out in hidden[1:-1]:                        # every layer's output (the last one is normed)
        assert torch.equal(layer_out[..., base:], hidden[0][..., base:])
    for lag in range(cfg.channel_lags + 1):
        slot = hidden[0][0, 10, base + 1 + lag * w:base + 1 + (lag + 1) * w]
        assert torch.equal(slot, table[ids[0, 10 - lag], base + 1:base + 1 + w])
    assert bool((hidden[0][0, :, base] == 1).all())


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


def test_train_target_smoke(tiny_stdlib, tmp_path, plain_mode):
    start = time.perf_counter()
    log = train_target.main(["--out", str(tmp_path / "target"), "--minutes", "0.005", "--seq-len", "64", "--batch", "2",
                             "--hidden", "64", "--vocab", "400", "--channel-lags", "2", "--channel-width", "4",
                             "--eval-lengths", "128", "--stdlib", str(tiny_stdlib), "--threads", "1"])
    wall = time.perf_counter() - start
    steps = log["total_steps"]
    assert steps >= 1 and all(s["loss"] == s["loss"] for s in log["steps"])                  # no NaN
    # the loop stops once its 0.3 s budget is spent: train_seconds (one decimal) lies between the
    # budget and the wall clock around the whole run
    assert 0.3 <= log["train_seconds"] <= wall + 0.05
    assert log["device"] == "cpu" and log["threads"] == 1
    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    assert isinstance(target, FoldToyForCausalLM) and target.dtype == torch.bfloat16
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "target")
    assert len(tokenizer) == target.config.vocab_size == 400
    assert tokenizer.mask_token_id == target.config.mask_token_id
    assert json.loads((tmp_path / "target" / "train_log.json").read_text())["total_steps"] == steps
    # every file is a plain file's (save_pretrained alone gives the weights 0600); no staging folder is left
    files = sorted((tmp_path / "target").iterdir())
    assert {"config.json", "model.safetensors", "train_log.json"} <= {f.name for f in files}
    for path in files:
        assert path.is_file() and path.stat().st_mode & 0o777 == plain_mode, path


@pytest.mark.parametrize("anchor_offset", [False, True])
def test_train_drafter_smoke(tiny_stdlib, tiny_tokenizer, tmp_path, anchor_offset, plain_mode):
    target = _tiny_target(tmp_path / "target", vocab=len(tiny_tokenizer), mask_token_id=tiny_tokenizer.mask_token_id)
    tiny_tokenizer.save_pretrained(tmp_path / "target")
    out = tmp_path / "drafter"
    log = train_drafter.main(["--target", str(tmp_path / "target"), "--out", str(out), "--max-steps", "2",
                              "--seq-len", "64", "--batch", "2", "--blocks", "4", "--block-size", "4", "--pool", "4",
                              "--heads", "4", "--taps", "1", "--stdlib", str(tiny_stdlib), "--max-offset", "5000",
                              "--threads", "1"] + (["--anchor-offset"] if anchor_offset else []))
    assert log["total_steps"] == 2 and log["device"] == "cpu"
    assert set(log["copy_ability"]) == {"slot_accuracy_on_copies", "copy_positions", "retrieval_tau"}
    assert math.isfinite(log["load_check_max_abs_diff"])
    drafter = load_drafter(out, target)
    assert drafter.cfg.block_size == 4 and drafter.cfg.target_layer_ids == [1]
    assert json.loads((out / "config.json").read_text())["fold_training"]["anchor_offset"] is anchor_offset
    for name in ("config.json", "model.safetensors", "train_log.json"):   # safetensors alone gives 0600
        assert (out / name).stat().st_mode & 0o777 == plain_mode, name
    # the loaded module's inference path reproduces the training forward, compared in float64 (two float32
    # paths that sum in different orders differ by machine): the same (bf16-rounded) weights, within
    # twice the float32 training forward's error of the float64 one
    ids = torch.randint(0, len(tiny_tokenizer), (1, 40), generator=torch.Generator().manual_seed(0))
    _, training = train_drafter.slot_logits_both_ways(drafter, target, ids)
    target64 = copy.deepcopy(target).double()
    inference, truth = train_drafter.slot_logits_both_ways(load_drafter(out, target64), target64, ids)
    assert truth.dtype == torch.float64 and training.dtype == torch.float32    # inference: float64 math, float32 logits
    check_close("inference path vs training forward", inference, truth, training, torch.float32)


def _tiny_drafter(tmp_path, target, block_size=4):
    from fold.spec_decode.drafter import Drafter
    from fold.spec_decode.loading import read_config

    args = train_drafter.parse_args(["--target", str(tmp_path / "target"), "--out", str(tmp_path / "d"),
                                     "--heads", "4", "--taps", "1", "--block-size", str(block_size)])
    args.out.mkdir(exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(train_drafter.drafter_config(target.config, args)))
    torch.manual_seed(1)
    drafter = Drafter(read_config(args.out, target.config))
    drafter.bind(target)
    return drafter


@pytest.mark.parametrize("window, alpha", [(4, 2.0), (9, 1.0), (17, 3.5)])
def test_training_through_folds_read_is_the_loops_fold_read(tmp_path, window, alpha):
    """block_logits(fold_read=(W, alpha)) equals the drafter's inference path reading its cache with
    fold.attention(window=W, alpha=alpha): compared in float64, within twice the float32 training
    forward's error (reference.tolerance); the plain read gives other logits, so far entries count."""
    target = _tiny_target(tmp_path / "target")
    drafter = _tiny_drafter(tmp_path, target)
    target64, drafter64 = copy.deepcopy(target).double(), copy.deepcopy(drafter).double()
    drafter64.bind(target64)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(window))
    inference, truth = train_drafter.slot_logits_both_ways(drafter64, target64, ids, fold_read=(window, alpha))
    _, training = train_drafter.slot_logits_both_ways(drafter, target, ids, fold_read=(window, alpha))
    assert truth.dtype == torch.float64 and training.dtype == torch.float32
    check_close("fold inference vs fold training forward", inference, truth, training, torch.float32)
    _, plain = train_drafter.slot_logits_both_ways(drafter64, target64, ids)
    assert (plain - truth).abs().max() > 1e-3


def test_folds_training_read_with_nothing_far_is_the_plain_read_and_has_finite_gradients(tmp_path):
    """Blocks whose context lies inside the window read as the plain read; a batch mixing such blocks
    with blocks that have far entries back-propagates without a NaN."""
    target = _tiny_target(tmp_path / "target")
    target = target.double()
    drafter = _tiny_drafter(tmp_path, target).double()
    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats = drafter.features(target(ids, output_hidden_states=True).hidden_states)
    anchors, positions = torch.tensor([[3, 10, 40, 55], [5, 20, 30, 50]]), torch.arange(64)[None].repeat(2, 1)
    plain = train_drafter.block_logits(drafter, feats, ids, anchors, positions)
    wide = train_drafter.block_logits(drafter, feats, ids, anchors, positions, fold_read=(56, 2.0))
    torch.testing.assert_close(wide, plain)
    folded = train_drafter.block_logits(drafter, feats, ids, anchors, positions, fold_read=(8, 2.0))
    torch.testing.assert_close(folded[:, :1], plain[:, :1])    # anchors 3 and 5: nothing 8 + 4 or more back
    assert (folded[:, 2:] - plain[:, 2:]).abs().max() > 1e-3
    folded.logsumexp(-1).sum().backward()
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_copy_circuit_copies_at_init(tiny_stdlib, tmp_path):
    """The closed-form copy circuit, before any training: on a sequence that repeats its first half,
    the first drafted slot names the token that followed the earlier occurrence."""
    target = _tiny_target(tmp_path / "target")
    args = train_drafter.parse_args(["--target", str(tmp_path / "target"), "--out", str(tmp_path / "d"),
                                     "--heads", "4", "--taps", "1", "--block-size", "4"])
    args.out.mkdir()
    (args.out / "config.json").write_text(json.dumps(train_drafter.drafter_config(target.config, args)))
    from fold.spec_decode.drafter import Drafter
    from fold.spec_decode.loading import read_config

    drafter = Drafter(read_config(args.out, target.config))
    drafter.bind(target)
    gen = torch.Generator().manual_seed(0)
    half = torch.randint(0, 250, (1, 60), generator=gen)
    ids = torch.cat([half, half], 1)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        feats = drafter.features(out.hidden_states)
    drafter_init.copy_circuit_init(drafter, target.config, (feats[0], ids[0]))
    anchors = torch.arange(70, 110)[None]
    logits = train_drafter.block_logits(drafter, feats, ids, anchors, torch.arange(124)[None])
    first = logits[0, :, 0].argmax(-1)
    assert (first == ids[0, anchors[0] + 1]).float().mean() > 0.6      # chance: about 1 / 250


@pytest.mark.parametrize("script, args, words", [
    ("target", ["--mix", "0.5", "0.5", "0.5", "0"], "--mix takes 4 shares >= 0 summing to 1"),
    ("target", ["--max-steps", "0"], "--max-steps: must be a positive int"),
    ("target", ["--seq-len", "-3"], "--seq-len: must be a positive int"),
    ("target", ["--vocab", "100"], "--vocab must be >= 300"),
    ("target", ["--device", "cuda:x"], "--device"),
    ("target", ["--channel-lags", "40"], "must be under half of --hidden"),
    ("drafter", ["--batch", "0"], "--batch: must be a positive int"),
    ("drafter", ["--blocks", "400"], "do not fit"),
    ("drafter", ["--heads", "3"], "--heads must be even"),
    ("drafter", ["--copy-anchors", "2"], "--copy-anchors in [0, 1]"),
    ("drafter", ["--refresh", "5000"], "must not exceed --pool"),
    ("drafter", ["--mix", "1", "0", "0", "0.5"], "summing to 1"),
])
def test_training_scripts_reject_bad_options(script, args, words, capsys, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    base = ["--out", str(tmp_path / "o")] + ([] if script == "target" else ["--target", str(tmp_path / "t")])
    parse = train_target.parse_args if script == "target" else train_drafter.parse_args
    with pytest.raises(SystemExit) as info:
        parse(base + args)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_anchor_offset_positions_keep_sinks():
    pos = train_drafter.sample_positions(random.Random(0), 3, 40, True, 4, 10_000)
    assert (pos[:, :4] == torch.arange(4)).all()
    assert ((pos[:, 5:] - pos[:, 4:-1]) == 1).all() and (pos[:, 4] >= 4).all()
    assert (train_drafter.sample_positions(random.Random(0), 2, 40, False, 4, 10_000) == torch.arange(40)).all()


def test_demo_module_paths():
    assert fold.demo.TARGET_DIR.parent == fold.demo.ARTIFACTS
