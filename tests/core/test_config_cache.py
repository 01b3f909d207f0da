"""The tuning machinery on the CPU: sweep with an injected timer -> JSON cache -> runtime lookup, the
checks on every cache entry, the split model, and the tuning CLI's arguments."""

import json

import pytest
import torch

import fold
import fold.kernels.fold_attention as kernels
from fold import config_lookup
from fold.config_lookup import num_splits_for
from fold.kernels.fold_attention import MIN_TILES_PER_SPLIT, SPACE, TILE_FIELDS
from tests.helpers import Case, kwargs_of, make_inputs
from tuning.__main__ import main as tuning_main
from benchmarks.workloads import DrafterShape
from tuning.tune import ShapeClass, tune

CLASS = ShapeClass(DrafterShape("test", n_q=4, heads_q=2, heads_kv=1, head_dim=32, window=16), dtype="float32",
                   keys_rotated=False)
CASE = Case(n_q=4, heads_kv=1, group=2, head_dim=32, rotary_dim=32, max_len=700, window=16)
TARGET = (16, 64, 8, 3)                       # a tile: block_m, block_n, num_warps, num_stages
QUIET = dict(device="cpu", log=lambda _: None)


def favour(target):
    """A fake timer: the target tile is fastest, everything else slow. Never launches."""
    def timer(config, calls):
        assert len(calls) >= 1 and all(callable(c) for c in calls)
        return 1.0 if config.tile == target else 2.0
    return timer


def model_config(tile, case=CASE):
    """The config fold launches for ``case`` with ``tile``: the split count comes from the model."""
    return config_lookup.config_from_tile(tile, batch=case.batch, heads_kv=case.heads_kv, n_q=case.n_q,
                                          group=case.group, head_dim=case.head_dim, max_len=case.max_len, sms=1,
                                          elt_bytes=torch.finfo(case.dtype).bits // 8)


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


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    config_lookup.clear_cache()


def test_tune_writes_the_favoured_tile_and_attention_launches_it_with_the_model_split(tuning_dir, launched):
    path = tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), **QUIET)
    assert path == tuning_dir / "cpu.json"
    data = json.loads(path.read_text())
    entry = data["entries"][CLASS.key(1024)]
    assert entry["config"] == dict(zip(TILE_FIELDS, TARGET))
    assert entry["us"] <= entry["heuristic_us"]
    assert set(entry["splits"]) >= {"model", "best", "best_us", "programs", "sms"}
    meta = data["_metadata"]
    assert meta["device"] == "cpu" and meta["kernel_hash"] == config_lookup.kernel_hash()
    assert {"fold", "triton", "torch", "cuda", "space_hash"} <= set(meta)
    assert not list(tuning_dir.glob("*.tmp")), "the write must be atomic (temp file renamed)"
    _attend()
    assert launched == [model_config(TARGET)]


def test_without_a_cache_the_heuristic_is_used(tuning_dir, launched):
    _attend()
    assert launched == [config_lookup.heuristic_config(batch=1, heads_kv=1, n_q=4, group=2, head_dim=32, max_len=700,
                                                       device=torch.device("cpu"), elt_bytes=4)]


def test_nearest_length_bucket_is_used_when_the_exact_one_is_missing(tuning_dir, launched):
    tune([CLASS], [4096], tuning_dir, timer=favour(TARGET), **QUIET)
    _attend()                                   # max_len 700 -> bucket 1024, tuned only at 4096
    assert launched[0].tile == TARGET


def test_other_shape_classes_do_not_use_the_entry(tuning_dir, launched):
    tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), **QUIET)
    _attend(CASE.with_(keys_rotated=True))      # another key layout: another class
    assert launched[0].tile != TARGET


def test_a_stale_cache_is_ignored_with_one_warning(tuning_dir, launched):
    path = tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), **QUIET)
    data = json.loads(path.read_text())
    data["_metadata"]["kernel_hash"] = "0" * 16
    _write(path, data)
    with pytest.warns(UserWarning, match="ignoring tuned configs") as record:
        _attend()
        _attend()
    assert len(record) == 1
    assert all(c.tile != TARGET for c in launched)


BAD_ENTRIES = [
    (dict(num_splits=0), "config field 'num_splits' is not a tile field"),
    (dict(block_n=0), "config field 'block_n' = 0 is not in the declared space"),
    (dict(block_n=24), "config field 'block_n' = 24 is not in the declared space"),
    (dict(block_n="32"), "config field 'block_n' must be an integer, got '32'"),
    (dict(num_warps=True), "config field 'num_warps' must be an integer, got True"),
    (dict(num_stages=2.0), "config field 'num_stages' must be an integer, got 2.0"),
    (dict(block_m=None), "config field 'block_m' must be an integer, got None"),
]


@pytest.mark.parametrize("change, words", BAD_ENTRIES)
def test_an_entry_outside_the_declared_space_is_ignored_with_a_warning_naming_file_and_field(
        tuning_dir, launched, change, words):
    """Such entries would give wrong answers (num_splits=0) or crash inside Triton."""
    path = tune([CLASS], [1024, 2048], tuning_dir, timer=favour(TARGET), **QUIET)
    data = json.loads(path.read_text())
    data["entries"][CLASS.key(1024)]["config"].update(change)
    _write(path, data)
    with pytest.warns(UserWarning) as record:
        _attend()                               # bucket 1024 is bad: the nearest good bucket (2048) is used
    messages = [str(w.message) for w in record]
    assert any(words in m and str(path) in m and CLASS.key(1024) in m for m in messages), messages
    assert launched == [model_config(TARGET)]


@pytest.mark.parametrize("content, words", [
    ('{"_metadata": {}, "entries": [}', "not valid JSON"),
    ("[]", "the top level must be an object"),
    ('{"entries": {}}', "field '_metadata' is missing"),
    ("{\"_metadata\": {}, \"entries\": []}", "field 'entries' must be an object, got list"),
    ("{\"_metadata\": [], \"entries\": {}}", "field '_metadata' must be an object, got list"),
])
def test_a_malformed_file_is_ignored_with_a_warning_naming_it(tuning_dir, launched, content, words):
    path = tuning_dir / "cpu.json"
    _write(path, content)
    with pytest.warns(UserWarning, match="ignoring tuned configs") as record:
        _attend()
    assert any(words in str(w.message) and str(path) in str(w.message) for w in record)
    assert launched == [config_lookup.heuristic_config(batch=1, heads_kv=1, n_q=4, group=2, head_dim=32, max_len=700,
                                                       device=torch.device("cpu"), elt_bytes=4)]


@pytest.mark.parametrize("key, words", [
    ("d32-g2-nq4-float32-unrotated", "key must look like"),
    ("d32-g2-nq4-float32-unrotated-L1000", "length bucket L1000 must be a power of two"),
])
def test_a_malformed_key_is_reported(tmp_path, key, words):
    data = {"_metadata": {}, "entries": {key: {"config": dict(zip(TILE_FIELDS, TARGET))}}}
    _, entries, problems = config_lookup.parse_cache(data, tmp_path / "x.json")
    assert entries == {} and len(problems) == 1 and words in problems[0] and "x.json" in problems[0]


def test_env_dir_comes_before_the_shipped_configs(tuning_dir, launched, monkeypatch, tmp_path_factory):
    shipped = tmp_path_factory.mktemp("shipped")
    other = (16, 16, 2, 1)
    tune([CLASS], [1024], shipped, timer=favour(other), **QUIET)
    monkeypatch.setattr(config_lookup, "SHIPPED_DIR", shipped)
    _attend()
    assert launched[-1].tile == other           # only the shipped cache exists
    tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), **QUIET)
    _attend()
    assert launched[-1].tile == TARGET          # the env folder wins


def test_tune_merges_entries_into_an_existing_cache(tuning_dir):
    tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), **QUIET)
    tune([CLASS], [2048], tuning_dir, timer=favour(TARGET), **QUIET)
    entries = json.loads((tuning_dir / "cpu.json").read_text())["entries"]
    assert set(entries) == {CLASS.key(1024), CLASS.key(2048)}


def test_the_tuner_never_times_a_tile_that_spills(tuning_dir):
    """The spill check runs before timing; a spilling tile is neither timed nor written."""
    timed, asked = [], []

    def timer(config, calls):
        timed.append(config.tile)
        return 0.5 if config.tile == TARGET else 1.0   # the spilling target would win if it were timed

    def spills(cls, tiles):
        asked.extend(tiles)
        return {t: 7 if t == TARGET else 0 for t in tiles}

    path = tune([CLASS], [1024], tuning_dir, timer=timer, spills=spills, **QUIET)
    assert TARGET in asked and TARGET not in timed and timed
    assert json.loads(path.read_text())["entries"][CLASS.key(1024)]["config"] != dict(zip(TILE_FIELDS, TARGET))


def test_tune_refuses_to_time_on_the_cpu_without_a_timer(tuning_dir):
    with pytest.raises(ValueError, match="timing needs a GPU"):
        tune([CLASS], [1024], tuning_dir, device="cpu")


def test_shape_key_buckets_lengths_by_powers_of_two():
    key = lambda n: config_lookup.shape_key(head_dim=128, group=4, n_q=10, dtype=torch.bfloat16,  # noqa: E731
                                            keys_rotated=False, max_len=n)
    assert key(1) == "d128-g4-nq16-bfloat16-unrotated-L1024"
    assert key(32768) == key(20000) == "d128-g4-nq16-bfloat16-unrotated-L32768"
    assert key(10**7) == "d128-g4-nq16-bfloat16-unrotated-L262144"


# --- the split model ---------------------------------------------------------------------------------------

LLAMA = dict(n_q=10, group=4, head_dim=128)


def test_the_split_model_reproduces_the_first_h200_tuning_run():
    """results/tools/h200-2026-11-29-gpu_check.log: a stage-1 kernel of 8 warps (one CTA per SM,
    132 slots), batch 1 x 8 KV heads; the sweep picked 16 splits at 8K and at 128K."""
    for length in (8192, 131072):
        for tile in ((64, 16, 8, 3), (64, 32, 8, 3)):
            assert num_splits_for(batch=1, heads_kv=8, max_len=length, tile=tile, num_sms=132, **LLAMA) == 16


def test_the_split_model_fills_the_slots_and_backs_off_with_more_programs():
    tile = (64, 64, 4, 2)                                        # two CTAs per SM
    assert config_lookup.resident_ctas(tile, 128) == 2
    one = num_splits_for(batch=1, heads_kv=8, max_len=131072, tile=tile, num_sms=132, **LLAMA)
    assert one == 32                                             # 8 x 32 = 256 of 264 slots
    counts = [num_splits_for(batch=b, heads_kv=8, max_len=131072, tile=tile, num_sms=132, **LLAMA)
              for b in (1, 2, 4, 8, 16, 64)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1
    assert all(c in SPACE["num_splits"] for c in counts)


def test_the_split_model_keeps_tiles_per_split_on_short_caches():
    tile = (64, 64, 4, 2)
    for length in (64, 300, 1024, 4096):
        splits = num_splits_for(batch=1, heads_kv=8, max_len=length, tile=tile, num_sms=132, **LLAMA)
        assert splits == 1 or -(-length // 64) // splits >= MIN_TILES_PER_SPLIT


def test_the_model_and_the_window_launch_pick_from_the_one_split_rule():
    for length in (64, 300, 4096, 131072):
        for block_n in (16, 64):
            counts = kernels.split_counts(length, block_n)
            assert counts[0] == 1 and set(counts) <= set(SPACE["num_splits"])
            assert all(s == 1 or -(-length // block_n) // s >= MIN_TILES_PER_SPLIT for s in counts)
            for heads_kv in (1, 8):
                tile = (64, block_n, 4, 2)
                splits = num_splits_for(batch=1, heads_kv=heads_kv, max_len=length, tile=tile, num_sms=132, **LLAMA)
                assert splits in counts
                window = kernels.window_splits(splits, length, 2048, 10, block_n)
                assert window <= splits and window in kernels.split_counts(min(length, 2048 + 19 + block_n), block_n)


# --- the tuning CLI ----------------------------------------------------------------------------------------

def test_cli_dry_run_and_show(tuning_dir, capsys):
    assert tuning_main(["tune", "--dry-run", "--drafters", "llama3.1-8b", "--layout", "unrotated"]) == 0
    out = capsys.readouterr().out
    assert "d128-g4-nq16-bfloat16-unrotated-L262144" in out and "timings in all" in out
    path = tune([CLASS], [1024], tuning_dir, timer=favour(TARGET), **QUIET)
    assert tuning_main(["show", str(path)]) == 0
    assert CLASS.key(1024) in capsys.readouterr().out


@pytest.mark.parametrize("content, words", [
    ("{not json", "not valid JSON"),
    ('{"_metadata": {}, "entries": []}', "field 'entries' must be an object"),
    ('{"_metadata": {}}', "field 'entries' is missing"),
    ('{"_metadata": {}, "entries": {"d32-g2-nq4-float32-unrotated-L1024": {"config": {"block_m": 16}}}}',
     "config field 'block_n' is missing"),
])
def test_cli_show_names_the_file_and_field_of_a_bad_cache(tmp_path, capsys, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert tuning_main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and str(path) in err and "Traceback" not in err


def test_cli_show_of_a_missing_file(tmp_path, capsys):
    assert tuning_main(["show", str(tmp_path / "none.json")]) == 2
    assert "cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("command, argv, words", [
    ("verify", ["--sample", "-1"], "--sample: must be a positive int"),
    ("verify", ["--sample", "0"], "--sample: must be a positive int"),
    ("verify", ["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
    ("verify", ["--budget-s", "nan"], "--budget-s: must be a positive float"),
    ("tune", ["tune", "--dry-run", "--lengths", "0"], "--lengths: must be a positive int"),
    ("tune", ["tune", "--dry-run", "--top-k", "0"], "--top-k: must be a positive int"),
    ("inspect", ["--arch", "-90"], "--arch: must be a positive int"),
])
def test_cli_rejects_bad_arguments_before_any_work(capsys, command, argv, words):
    from tools import static_report, verify_configs

    main = {"tune": tuning_main, "verify": verify_configs.main, "inspect": static_report.main}[command]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err
