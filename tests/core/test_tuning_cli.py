"""The GPU script's CPU paths (``tools/gpu_check.py``: arguments, plan, the precompile it starts
with, the table it ends with) and ``python -m tools.static_report``'s own arguments, so a lent GPU's
minutes are not lost to a bug that a CPU can find."""

import json
import subprocess
import sys

import pytest

from fold.config_lookup import heuristic_tile
from fold.kernels.fold_attention import SPACE
from tools import gpu_check, static_report


def test_dry_run_prints_the_plan(capsys):
    assert gpu_check.main(["--dry-run", "--lengths", "8192", "131072"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["sections"] == list(gpu_check.SECTIONS)
    assert plan["fused_read"]["lengths"] == [8192, 131072]
    assert plan["verify"]["configs"] > plan["verify"]["tiles_before_spill_check"] > 0
    # every drafter class has tiles to tune; n_q 7 and 8 share one class, 10 and 16 another
    assert len(plan["tune"]["classes"]) == 4 and all(plan["tune"]["tiles_per_class"].values())


def test_without_a_gpu_it_stops_before_any_work(capsys, tmp_path):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["--budget-s", "0"], ["--lengths", "-8"], ["--skip", "everything"],
                                  ["--drafters", "gpt2"], ["--workers", "nan"]])
def test_bad_arguments_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.parse_args(argv)
    assert info.value.code == 2


def test_the_kept_tiles_hold_the_heuristic_and_every_split_is_verified():
    for rows in (28, 32, 40, 64):
        assert heuristic_tile(rows=rows, head_dim=128) in gpu_check.kept_tiles(rows, 128)
    tiles = gpu_check.kept_tiles(40, 128)
    configs = gpu_check.verify_configs(tiles)
    assert {c.tile for c in configs} == set(tiles)
    assert {c.num_splits for c in configs} == set(SPACE["num_splits"])


def test_the_table_renders_a_full_and_a_cut_off_run():
    row = dict(drafter="llama3.1-8b", length=131072, fold_unrot_us=150.0, fold_rot_us=160.0, full_us=156.0,
               paper_us=233.0, fold_tbps=3.58, fold_rot_tbps=3.35, full_tbps=3.44, full="torch_flash_full",
               paper="torch_flash_paper_layout", config_unrot={}, config_rot={})
    full = dict(env=dict(device="NVIDIA H200", torch="2.11", triton="3.6", flash_attn=False),
                verify=dict(configs=10, checked=50, failures=[]), copy_bandwidth=4.3,
                graphs=dict(tree_attention=dict(replay_equals_eager=True, after_inputs_change=True)),
                fused_read=[row], fused_read_tuned=[row], skipped=[], errors={})
    table = gpu_check.render_table(full)
    assert "verify: 50 checks of 10 configs" in table and "copy bandwidth: 4.30 TB/s" in table
    assert "0.96x" in table and "83%" in table            # 150 / 156 us; 3.58 of 4.3 TB/s
    cut = gpu_check.render_table(dict(env={}, skipped=["tune"], errors={"fused_read": "Traceback"}))
    assert "skipped (out of time): tune" in cut and "errors in: fused_read" in cut


def test_the_precompile_compiles_a_tile_for_sm90_without_a_gpu(tmp_path):
    """The first section of a GPU run, on one tile, in a child without the interpreter."""
    code = """
import json
from types import SimpleNamespace
from tools import gpu_check
tile = (64, 64, 4, 2)
gpu_check.kept_tiles = lambda rows, head_dim: [tile]          # one tile for the tuning classes too
res = gpu_check.precompile([tile], gpu_check.drafter_classes(["llama3.1-8b"], layouts=(True,)),
                           SimpleNamespace(workers=2), print)
print(json.dumps(res))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env=static_report.child_env(), cwd=static_report.ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["spilling_tiles"] == []
    kernels = {x["kernel"] for reads in res["reads"].values() for x in reads}
    assert {"prologue", "stage1[window]", "stage1[far]", "stage2", "tree_fwd_kernel"} <= kernels


def test_inspect_refuses_to_run_under_the_interpreter(capsys):
    assert static_report.main(["--drafters", "llama3.1-8b"]) == 2      # the test session interprets
    assert "TRITON_INTERPRET=1 is set" in capsys.readouterr().err


def test_inspect_rejects_an_unknown_drafter(capsys):
    with pytest.raises(SystemExit):
        static_report.main(["--drafters", "gpt2"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("before", [None, "/elsewhere"])
def test_the_tuned_read_section_restores_fold_tuning_dir(monkeypatch, tmp_path, before):
    if before is None:
        monkeypatch.delenv("FOLD_TUNING_DIR", raising=False)
    else:
        monkeypatch.setenv("FOLD_TUNING_DIR", before)
    with gpu_check.tuning_dir(tmp_path):
        assert gpu_check.os.environ["FOLD_TUNING_DIR"] == str(tmp_path)
    assert gpu_check.os.environ.get("FOLD_TUNING_DIR") == before


def test_bench_verify_runs_on_small_shapes(capsys):
    """benchmarks/bench_verify.py end to end on small shapes (a benchmark: only that it runs and reports)."""
    from benchmarks import bench_verify

    bench_verify.main(["--lengths", "64", "--rows", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                       "--vocab", "50", "--hidden", "16", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "64 keys: transformers" in out and "grouped" in out and "LM head 50 x 16: 3 rows" in out


def test_bench_vllm_keeps_code_and_the_retrieval_prompts_the_target_answers():
    from benchmarks import bench_vllm

    items = [("code", 8, [1], None), ("retrieval", 8, [2], [5, 6]), ("retrieval", 8, [3], [5, 7]),
             ("retrieval", 8, [4], [9]), ("retrieval", 16, [5], [1]), ("code", 16, [6], None)]
    ar = [dict(tokens=t) for t in ([0], [5, 7, 0], [5, 7, 0], [9, 9], [2], [0])]
    # the first answered retrieval prompt per length (index 2; index 3 is past per_length), code always
    assert bench_vllm.keep_answered(items, ar, per_length=1) == [0, 2, 5]
    assert bench_vllm.keep_answered(items, ar, per_length=2) == [0, 2, 3, 5]
