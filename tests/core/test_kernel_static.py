"""What fold launches on an H200, compiled for sm_90 on this CPU (``python -m tools.static_report``): no
register spills for the drafter shapes with 1, 2, 4 and 8 KV heads at batch 1 up to 256K (where the
split model picks up to 128 splits, so stage 2 merges up to 256 states a row), two CTAs per SM for
the 4-warp stage-1 kernels, and at least the occupancy the split model assumes.

The test session runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``), which has no
compiler, so the report runs once in a child process without it.
"""

import json
import subprocess
import sys

import pytest

from benchmarks.workloads import DRAFTERS
from fold import config_lookup
from tools import static_report

LENGTHS = ("8192", "32768", "131072", "262144")
HEADS_KV = ("1", "2", "4", "8")
CONTROL = """
import json
from tools.static_report import stage1_spills
from benchmarks.workloads import DRAFTERS
from fold.config_lookup import heuristic_tile
shape = DRAFTERS["llama3.1-8b"]
good = heuristic_tile(rows=shape.n_q * shape.heads_q // shape.heads_kv, head_dim=shape.head_dim)
counts = stage1_spills(shape, True, [good, (64, 64, 2, 2)])
print(json.dumps({"good": counts[good], "two_warps": counts[(64, 64, 2, 2)]}))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    dump = tmp_path_factory.mktemp("cubins")
    done = static_report.inspect_in_subprocess(["--json", "--dump", str(dump), "--lengths", *LENGTHS,
                                                  "--heads-kv", *HEADS_KV])
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout), dump, done.returncode


def test_every_launch_for_the_drafter_shapes_compiles_without_spills(report):
    records, _, returncode = report
    assert {r["shape"] for r in records} == set(DRAFTERS)
    assert {r["length"] for r in records} == {int(n) for n in LENGTHS}
    assert {r["heads_kv"] for r in records} == {int(n) for n in HEADS_KV}
    # the largest split count of the space is launched (one KV head, batch 1)
    assert max(r["config"]["num_splits"] for r in records if r["kernel"] == "stage1[far]") == 128
    assert {r["keys_rotated"] for r in records} == {False, True}
    # fold.tree_attention's cached read is a plain read: no prologue
    assert {r["kernel"] for r in records} == {"prologue", "stage1[window]", "stage1[far]", "stage1[far-pages]",
                                              "stage2", "tree/stage1[plain]", "tree/stage2", "tree_fwd_kernel"}
    # the budgeted far read (a page list) of both key layouts, dense and served from vLLM's pages
    budget = {(r["read"], r["keys_rotated"]) for r in records if r["kernel"] == "stage1[far-pages]"}
    assert budget == {("fold-budget", False), ("fold-budget", True), ("serve-budget", False)}
    spilling = [static_report.format_row(r) for r in records if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, "\n".join(spilling)
    assert returncode == 0


def test_records_carry_the_documented_fields_and_the_cubins_are_dumped(report):
    records, dump, _ = report
    for r in records:
        assert {"kernel", "shape", "heads_kv", "length", "keys_rotated", "config", "arch", "registers", "spill_stores",
                "spill_loads", "shared_bytes", "wgmma", "fp64", "cubin"} <= set(r)
        assert r["arch"] == "sm_90" and 0 < r["registers"] <= 255
        assert (dump / r["cubin"]).stat().st_size > 0
    # the stage-1 loops run on Hopper's warpgroup MMA
    assert all(r["wgmma"] > 0 for r in records if "stage1[" in r["kernel"])


def test_the_far_loop_fold_vllm_launches_rotates_nothing(report):
    """fold.vllm's cache holds un-rotated keys (issue 44): the far loop of every read it serves holds no float64
    arithmetic (the kernels' rotation angles, and nothing else, are float64), while the far loop over rotated
    keys and the window loop over un-rotated ones do: the count tells the two apart."""
    records, _, _ = report
    far = [r for r in records if r["kernel"].startswith("stage1[far")]
    served = [r for r in far if r["read"].startswith("serve-")]
    assert served and all(not r["keys_rotated"] and r["fp64"] == 0 for r in served), \
        [static_report.format_row(r) for r in served if r["fp64"]]
    assert all(r["fp64"] > 0 for r in far if r["keys_rotated"])
    assert all(r["fp64"] > 0 for r in records if r["kernel"] == "stage1[window]" and not r["keys_rotated"])


def test_stage1_holds_the_ctas_per_sm_the_split_model_assumes(report):
    records, _, _ = report
    for r in records:
        if "stage1" not in r["kernel"]:
            continue
        c = r["config"]
        if c["num_warps"] == 4:     # 8-warp tiles (128 rows: the large GQA groups) hold one
            assert r["ctas_per_sm"] >= 2, static_report.format_row(r)
        # the model's occupancy (for the config's tile) must not be more than the compiled kernel gets
        tile = (c["block_m"], c["block_n"], c["num_warps"], c["num_stages"])
        assert config_lookup.resident_ctas(tile, 128) <= r["ctas_per_sm"], static_report.format_row(r)


def test_the_static_check_tells_a_spilling_tile_from_a_clean_one():
    """The control for the tests above: two warps holding a 64 x 128 fp32 accumulator must spill."""
    done = subprocess.run([sys.executable, "-c", CONTROL], capture_output=True, text=True, timeout=600,
                          env=static_report.child_env(), cwd=static_report.ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["good"] == 0 and counts["two_warps"] > 0
