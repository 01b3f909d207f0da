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
