"""tools.compare_runs: two fold-demo runs paired prompt by prompt."""

import json

import pytest

from fold.demo import experiment
from fold.spec_decode.metrics import bootstrap_ci
from tools import compare_runs


def records(taus: dict[str, list[float]], prompts=("p1", "p2", "p3"), task="natural-mail", length=4096):
    rows = []
    for name, values in taus.items():
        row = experiment.Row(name, None)
        row.taus, row.tpots, row.prompts = list(values), [[1.0]] * len(values), list(prompts)
        rows.append(row)
    return experiment.cell_records(task, length, rows)


def rounded_ci(values):
    return [round(x, 4) for x in bootstrap_ci(values)[1:]]


def test_differences_are_paired_by_prompt_and_averaged_over_lengths():
    a = records({"AR": [1] * 3, "window": [1.0, 2.0, 1.5], "fold": [1.5, 2.0, 1.5]}) + \
        records({"AR": [1] * 2, "window": [1.0, 1.0], "fold": [1.0, 2.0]}, prompts=("q1", "q2"), length=8192)
    b = records({"AR": [1] * 3, "window": [1.0, 1.5, 1.5], "fold": [2.5, 2.0, 3.0]}) + \
        records({"AR": [1] * 2, "window": [1.5, 1.0], "fold": [2.0, 2.0]}, prompts=("q1", "q2"), length=8192)
    rows = {(r["length"], r["policy"]): r for r in compare_runs.compare(a, b)}
    assert ("AR" not in {p for _, p in rows})
    fold4 = rows[(4096, "fold")]
    assert (fold4["n"], fold4["tau_a"], fold4["tau_b"]) == (3, round(5 / 3, 4), round(7.5 / 3, 4))
    assert fold4["delta_tau"] == round((1.0 + 0.0 + 1.5) / 3, 4)
    assert fold4["delta_tau_ci"] == rounded_ci([[1.0, 0.0, 1.5]])
    # (fold - window) of B minus that of A, prompt by prompt: (1.5, 0.5, 1.5) - (0.5, 0, 0)
    assert fold4["delta_minus_window"] == round((1.0 + 0.5 + 1.5) / 3, 4)
    assert fold4["delta_minus_window_ci"] == rounded_ci([[1.0, 0.5, 1.5]])
    assert "delta_minus_window" not in rows[(4096, "window")]
    every = rows[(None, "fold")]                    # both lengths, prompts resampled within each
    assert every["n"] == 5
    assert every["delta_tau"] == round((2.5 / 3 + 0.5) / 2, 4)
    assert every["delta_minus_window_ci"] == rounded_ci([[1.0, 0.5, 1.5], [0.5, 0.0]])
    table = compare_runs.format_rows(compare_runs.compare(a, b))
    assert "natural-mail" in table and "+0.83 [" in table and "all" in table


def test_runs_over_different_prompts_are_refused():
    a = records({"AR": [1] * 3, "fold": [1.0, 1.0, 1.0]})
    b = records({"AR": [1] * 3, "fold": [2.0, 2.0, 2.0]}, prompts=("p1", "p2", "other"))
    with pytest.raises(ValueError, match="natural-mail 4096 fold: the two runs measured different prompts"):
        compare_runs.compare(a, b)
    old = [dict(r, prompts=[]) for r in a]           # a run written before records named their prompts
    with pytest.raises(ValueError, match="different prompts"):
        compare_runs.compare(old, old)


def test_the_command_reads_two_out_folders(tmp_path, capsys):
    for name, fold_taus in (("a", [1.0, 1.0, 2.0]), ("b", [2.0, 2.0, 2.0])):
        (tmp_path / name).mkdir()
        recs = records({"AR": [1] * 3, "window": [1.0] * 3, "fold": fold_taus})
        (tmp_path / name / "results.json").write_text(json.dumps(recs))
    compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert "fold" in out and "+0.67" in out
    assert json.loads((tmp_path / "c.json").read_text())[0]["task"] == "natural-mail"
    with pytest.raises(SystemExit):
        compare_runs.main([str(tmp_path / "a"), str(tmp_path / "missing")])
    assert "no fold-demo results" in capsys.readouterr().err


def test_a_measured_cell_names_its_prompts():
    """measure_cell records each measured prompt's digest; equal token ids give equal digests."""
    import torch

    class Result:
        def __init__(self, seq):
            self.sequences = seq
            self.stats = {"per_sequence": [{"tpot_s": 1.0, "committed_per_round": [1], "rounds": 1}]}

    rows = [experiment.Row("AR", lambda p, n: Result(p)), experiment.Row("fold", lambda p, n: Result(p))]
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    experiment.measure_cell(rows, ids, 2, repeats=1)
    digests = [experiment.prompt_digest(ids[i:i + 1]) for i in range(2)]
    assert rows[0].prompts == rows[1].prompts == digests and digests[0] != digests[1]
    assert experiment.cell_records("code", 3, rows)[1]["prompts"] == digests
    assert experiment.prompt_digest(ids[:1].clone()) == digests[0]


def test_another_drafters_rows_in_the_same_run_are_paired_with_its_own_window():
    """make_rows(versus=...) adds rows POLICY@NAME after the first drafter's (no anchor-offset row);
    cell_records pairs fold@NAME with window@NAME; split_versus takes them apart for compare."""
    rows = experiment.make_rows("target", "first", "anchor", ["window", "fold", experiment.ANCHOR_ROW], 64, 2.0,
                                256, versus={"b": "second"})
    assert [r.name for r in rows] == ["AR", "window", "fold", experiment.ANCHOR_ROW, "window@b", "fold@b"]
    taus = {"AR": [1.0] * 3, "window": [1.0, 2.0, 1.5], "fold": [1.5, 2.0, 1.5],
            "window@b": [1.0, 1.5, 1.5], "fold@b": [2.5, 2.0, 3.0]}
    recs = {r["policy"]: r for r in records(taus)}
    assert recs["fold@b"]["tau_minus_window"] == round((1.5 + 0.5 + 1.5) / 3, 4)       # against window@b
    assert recs["fold"]["tau_minus_window"] == round((0.5 + 0 + 0) / 3, 4)
    mine, theirs = compare_runs.split_versus(list(recs.values()), "b")
    assert {r["policy"] for r in mine} == {"AR", "window", "fold"} and {r["policy"] for r in theirs} == {"window", "fold"}
    fold4 = next(r for r in compare_runs.compare(mine, theirs) if r["policy"] == "fold" and r["length"] == 4096)
    assert fold4["delta_tau"] == round((1.0 + 0.0 + 1.5) / 3, 4)
    assert fold4["delta_minus_window"] == round((1.0 + 0.5 + 1.5) / 3, 4)
    with pytest.raises(ValueError, match=r"no rows of drafter 'c' \(POLICY@c\); it holds \['b'\]"):
        compare_runs.split_versus(list(recs.values()), "c")


def test_the_command_compares_a_run_with_its_versus_rows(tmp_path, capsys):
    recs = records({"AR": [1] * 3, "window": [1.0] * 3, "fold": [1.0, 1.0, 2.0], "window@b": [1.0] * 3,
                    "fold@b": [2.0] * 3})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(recs))
    compare_runs.main([str(tmp_path / "run"), "--versus", "b"])
    assert "+0.67" in capsys.readouterr().out
    for bad in ([str(tmp_path / "run")], [str(tmp_path / "run"), str(tmp_path / "run"), "--versus", "b"]):
        with pytest.raises(SystemExit):
            compare_runs.main(bad)
        assert "give either a second run B or --versus NAME" in capsys.readouterr().err
