"""The tuning machinery on the CPU: sweep with an injected timer -> JSON cache -> runtime lookup."""

import json

import pytest
import torch

import fold
import fold.kernels.fold_attention as kernels
from fold import config_lookup
from fold.kernels.fold_attention import FoldConfig
from tests.helpers import Case, kwargs_of, make_inputs
from tuning.__main__ import main as tuning_main
from tuning.tune import ShapeClass, tune

CLASS = ShapeClass(head_dim=32, group=2, n_q=4, dtype="float32", keys_rotated=False, heads_kv=1, window=16)
CASE = Case(n_q=4, heads_kv=1, group=2, head_dim=32, rotary_dim=32, max_len=700, window=16)
TARGET = FoldConfig(block_m=16, block_n=64, num_splits=4, num_warps=8, num_stages=3)


def favour(target):
    """A fake timer: the target is fastest, its tile next, everything else slow. Never launches."""
    tile = lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages)  # noqa: E731

    def timer(config, calls):
        assert len(calls) >= 1 and all(callable(c) for c in calls)
        return 1.0 if config == target else 1.5 if tile(config) == tile(target) else 2.0
    return timer


@pytest.fixture
def tuning_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLD_TUNING_DIR", str(tmp_path))
    config_lookup.clear_cache()
    yield tmp_path
    config_lookup.clear_cache()


@pytest.fixture
def launched(monkeypatch):
    """Records the config of every Triton launch."""
    seen = []
    real = kernels.fold_attention_fwd

    def spy(*args, config, **kwargs):
        seen.append(config)
        return real(*args, config=config, **kwargs)
    monkeypatch.setattr(kernels, "fold_attention_fwd", spy)
    return seen


def _attend(case=CASE):
    q, k, v, seqlens = make_inputs(case)
    return fold.attention(q, k, v, **kwargs_of(case, seqlens), backend="triton")


def test_tune_writes_the_favoured_config_and_attention_launches_with_it(tuning_dir, launched):
    path = tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    assert path == tuning_dir / "cpu.json"
    data = json.loads(path.read_text())
    key = CLASS.key(1024)
    assert data["entries"][key]["config"] == TARGET.as_dict()
    assert data["entries"][key]["us"] <= data["entries"][key]["heuristic_us"]
    meta = data["_metadata"]
    assert meta["device"] == "cpu" and meta["kernel_hash"] == config_lookup.kernel_hash()
    assert {"fold", "triton", "torch", "cuda", "space_hash"} <= set(meta)
    assert not list(tuning_dir.glob("*.tmp")), "the write must be atomic (temp file renamed)"
    _attend()
    assert launched == [TARGET]


def test_without_a_cache_the_heuristic_is_used(tuning_dir, launched):
    _attend()
    assert launched == [config_lookup.heuristic_config(batch=1, heads_kv=1, rows=8, head_dim=32, max_len=700,
                                                       device=torch.device("cpu"))]


def test_nearest_length_bucket_is_used_when_the_exact_one_is_missing(tuning_dir, launched):
    tune([CLASS], [4096], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    _attend()                                   # max_len 700 -> bucket 1024, tuned only at 4096
    assert launched == [TARGET]


def test_other_shape_classes_do_not_use_the_entry(tuning_dir, launched):
    tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    _attend(CASE.with_(keys_rotated=True))      # another key layout: another class
    assert launched[0] != TARGET


def test_a_stale_cache_is_ignored_with_one_warning(tuning_dir, launched):
    path = tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    data = json.loads(path.read_text())
    data["_metadata"]["kernel_hash"] = "0" * 16
    path.write_text(json.dumps(data))
    config_lookup.clear_cache()
    with pytest.warns(UserWarning, match="ignoring tuned configs") as record:
        _attend()
        _attend()
    assert len(record) == 1
    assert TARGET not in launched


def test_env_dir_comes_before_the_shipped_configs(tuning_dir, launched, monkeypatch, tmp_path_factory):
    shipped = tmp_path_factory.mktemp("shipped")
    other = FoldConfig(block_m=16, block_n=16, num_splits=2, num_warps=2, num_stages=1)
    tune([CLASS], [1024], shipped, timer=favour(other), device="cpu", log=lambda _: None)
    monkeypatch.setattr(config_lookup, "SHIPPED_DIR", shipped)
    _attend()
    assert launched[-1] == other                # only the shipped cache exists
    tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    _attend()
    assert launched[-1] == TARGET               # the env folder wins


def test_tune_merges_entries_into_an_existing_cache(tuning_dir):
    tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    tune([CLASS], [2048], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    entries = json.loads((tuning_dir / "cpu.json").read_text())["entries"]
    assert set(entries) == {CLASS.key(1024), CLASS.key(2048)}


def test_tune_refuses_to_time_on_the_cpu_without_a_timer(tuning_dir):
    with pytest.raises(ValueError, match="timing needs a GPU"):
        tune([CLASS], [1024], tuning_dir, device="cpu")


def test_cli_dry_run_and_show(tuning_dir, capsys):
    assert tuning_main(["tune", "--dry-run", "--drafters", "llama3.1-8b", "--layout", "unrotated"]) == 0
    out = capsys.readouterr().out
    assert "d128-g4-nq16-bfloat16-unrotated-L262144" in out and "timings in all" in out
    path = tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), device="cpu", log=lambda _: None)
    assert tuning_main(["show", str(path)]) == 0
    assert CLASS.key(1024) in capsys.readouterr().out


def test_shape_key_buckets_lengths_by_powers_of_two():
    key = lambda n: config_lookup.shape_key(head_dim=128, group=4, n_q=10, dtype=torch.bfloat16,  # noqa: E731
                                            keys_rotated=False, max_len=n)
    assert key(1) == "d128-g4-nq16-bfloat16-unrotated-L1024"
    assert key(32768) == key(20000) == "d128-g4-nq16-bfloat16-unrotated-L32768"
    assert key(10**7) == "d128-g4-nq16-bfloat16-unrotated-L262144"
