"""The shipped demo pair (through the public loading path) and a reduced ``fold-demo`` run."""

import json
import random
import statistics
from pathlib import Path

import pytest
import torch
import transformers

import fold.demo
from fold import files, spec_decode
from fold.demo import cli, corpus, experiment, tokens
from fold.demo.prompts import code_prompt, retrieval_prompt
from fold.spec_decode.policies import BUILT
from reference import apply_rope, rope_attention_ref
from reference.tolerance import check_close
from tests.spec_decode_fixtures import greedy_ar, padded_batch

# results.json keeps tau, its interval and the per-prompt taus to 4 decimals: a mean or a bootstrap
# quantile recomputed from the rounded taus moves by at most 5e-5, and rounding it again by 5e-5 more
ROUNDED = 1e-4

pytestmark = pytest.mark.skipif(not (fold.demo.DRAFTER_DIR / "model.safetensors").is_file(),
                                reason="demo artifacts not trained yet")


@pytest.fixture(scope="module")
def pair():
    return experiment.load_pair()


@pytest.fixture(scope="module")
def held_ids(pair):
    return {name: tokens.encode(pair[3], text) for name, text in corpus.held_out_code().items()}


def test_shipped_artifacts_are_small_and_in_real_formats(pair):
    def size(d):
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    real = fold.demo.ARTIFACTS / "real_drafter"
    toy = size(fold.demo.ARTIFACTS) - size(real)
    assert toy <= 25 * 2**20, f"the toy pair's artifacts take {toy / 2**20:.1f} MiB"
    assert 0 < size(real) <= 25 * 2**20, f"the real pair's drafter takes {size(real) / 2**20:.1f} MiB"
    target_config = json.loads((fold.demo.TARGET_DIR / "config.json").read_text())
    assert target_config["model_type"] == "fold_toy"
    tokenizer = transformers.AutoTokenizer.from_pretrained(fold.demo.TARGET_DIR)
    assert len(tokenizer) == target_config["vocab_size"] and tokenizer.mask_token_id == target_config["mask_token_id"]
    for d in (fold.demo.DRAFTER_DIR, fold.demo.ANCHOR_DRAFTER_DIR):
        config = json.loads((d / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"]
        assert config["dflash_config"]["mask_token_id"] == tokenizer.mask_token_id
        assert json.loads((d / "train_log.json").read_text())["device"] in ("cpu", "cuda")


@pytest.mark.parametrize("policy", BUILT)
def test_shipped_pair_is_lossless_on_every_policy(pair, held_ids, policy):
    target, drafter, _, tokenizer = pair
    rng = random.Random(7)
    prompts = [torch.tensor(code_prompt(held_ids, rng, 300)),
               torch.tensor(retrieval_prompt(rng, tokenizer, 400, 200)[0])]
    ids, mask = padded_batch(prompts)
    opts = experiment.policy_options(policy, window=32, alpha=2.0, train_len=64)     # long-context paths at ~350 tokens
    out = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=12, policy=policy, **opts)
    for b, p in enumerate(prompts):
        expected = greedy_ar(target, p, 12)
        assert torch.equal(out.sequences[b, :len(expected)], expected), f"row {b} differs from the target's greedy"


def test_anchor_offset_drafter_is_lossless(pair):
    target, _, anchor, tokenizer = pair
    prompt = torch.tensor(retrieval_prompt(random.Random(1), tokenizer, 500, 250)[0])
    out = spec_decode.generate(target, anchor, prompt[None], max_new_tokens=16, policy="dflash")
    assert torch.equal(out.sequences[0], greedy_ar(target, prompt, 16))


def test_shipped_drafter_copies_from_far_back_only_through_the_far_memory(pair):
    """A value stored 700+ tokens back: FOLD's far memory reaches it, FOLD's window alone does not."""
    target, drafter, _, tokenizer = pair
    prompt, answer = retrieval_prompt(random.Random(5), tokenizer, 1024, 700)
    ids = torch.tensor([prompt])
    taus = {policy: spec_decode.generate(target, drafter, ids, max_new_tokens=len(answer), policy=policy, window=128).tau
            for policy in ("window", "fold")}
    assert taus["fold"] >= taus["window"] + 1.0, taus


def test_tree_verification_is_refused_for_the_toy_target(pair):
    target, drafter, _, tokenizer = pair
    with pytest.raises(ValueError, match="AttentionInterface"):
        spec_decode.generate(target, drafter, torch.tensor([tokens.encode(tokenizer, "def f(x):\n")]), max_new_tokens=4,
                      tree=(2, 2))


def test_reduced_demo_runs_and_reports(tmp_path, capsys):
    code = cli.main(["--lengths", "512", "--rows", "dflash", "window", "fold", "--prompts", "2", "--new-tokens", "8",
                     "--repeats", "2", "--window", "64", "--out", str(tmp_path), "--no-progress", "--shift"])
    assert code == 0
    records = json.loads((tmp_path / "results.json").read_text())
    keys = {"task", "length", "policy", "tau", "tau_ci", "speedup", "speedup_ci", "lossless", "taus",
            "tpot_ms_per_prompt", "repeats"}
    cells = [r for r in records if r["task"] != "shift"]
    assert all(keys <= set(r) for r in cells) and all(r["repeats"] == 2 for r in cells)
    assert {(r["task"], r["policy"]) for r in cells} == {
        (t, p) for t in ("code", "retrieval") for p in ("AR", "dflash", "window", "fold")}
    for r in cells:        # the paired difference to Window is the mean of the per-prompt differences
        if r["policy"] in ("dflash", "fold"):
            window = next(w for w in cells if w["task"] == r["task"] and w["policy"] == "window")
            diffs = [a - b for a, b in zip(r["taus"], window["taus"])]
            assert r["tau_minus_window"] == pytest.approx(sum(diffs) / len(diffs), abs=1.5 * ROUNDED)  # two roundings
    shifted = [r for r in records if r["task"] == "shift"]
    train_len = experiment.training_length()
    assert {(r["policy"], r["shift"]) for r in shifted} == {(p, f * train_len)
                                                            for p in ("dflash", experiment.ANCHOR_ROW)
                                                            for f in experiment.SHIFT_FACTORS}
    assert all(r["lossless"] for r in records)
    for r in records:      # tau is the mean of the per-prompt taus, its interval their bootstrap's
        _, low, high = spec_decode.bootstrap_ci([r["taus"]])
        assert r["tau"] == pytest.approx(statistics.mean(r["taus"]), abs=ROUNDED)
        assert r["tau_ci"] == pytest.approx([low, high], abs=ROUNDED)
    assert (tmp_path / "tau_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    n = 6 + len(shifted)
    assert f"lossless: {n}/{n} rows" in printed and "tau - Window (paired)" in printed


class _FakeResult:
    def __init__(self, sequences, tpot, tau=2.0):
        self.sequences, self.tau = sequences, tau
        self.stats = dict(per_sequence=[dict(tpot_s=tpot, committed_per_round=[2, 2], rounds=2)])


def test_rows_run_interleaved_and_tpot_is_the_median_of_repeats():
    """Per prompt the rows run AR, A, B, AR, A, B, ... (so drifting machine load hits every row alike);
    a prompt's TPOT is the median of its repeats; a row whose output differs from AR's is marked."""
    calls = []
    tpots = {"AR": iter([4.0, 9.0, 5.0, 4.0, 4.0, 4.0]), "a": iter([1.0, 2.0, 30.0, 2.0, 2.0, 2.0]),
             "b": iter([2.0] * 6)}

    def runner(name, differs=False):
        def run(prompt, n_new):
            calls.append((name, int(prompt[0, 0])))
            seq = prompt.clone() if not differs else prompt + 1
            return _FakeResult(seq, next(tpots[name]))
        return run

    rows = [experiment.Row("AR", runner("AR")), experiment.Row("a", runner("a")),
            experiment.Row("b", runner("b", differs=True))]
    experiment.measure_cell(rows, torch.tensor([[10], [20]]), 4, repeats=3)
    assert calls == [(n, p) for p in (10, 20) for _ in range(3) for n in ("AR", "a", "b")]
    records = {r["policy"]: r for r in experiment.cell_records("code", 1, rows)}
    assert records["a"]["tpot_ms_per_prompt"] == [2000.0, 2000.0]            # medians of (1, 2, 30) and (2, 2, 2)
    assert records["AR"]["tpot_ms_per_prompt"] == [5000.0, 4000.0]
    assert records["a"]["speedup"] == (5 / 2 + 4 / 2) / 2                  # AR's median TPOT over a's, per prompt
    assert records["a"]["speedup_ci"] == [round(x, 4) for x in spec_decode.bootstrap_ci([[5 / 2, 4 / 2]])[1:]]
    assert records["a"]["lossless"] and not records["b"]["lossless"]


def test_retrieval_cells_measure_only_prompts_the_target_answers():
    """With answers, a prompt whose AR output does not begin with its stored value is skipped after
    that one AR run; a kept prompt's checking run is AR's first repeat; drawing stops at ``wanted``."""
    calls = []
    said = {10: [7, 8], 20: [7, 9], 30: [5, 5], 40: [7, 8]}         # what the "target" generates per prompt

    def runner(name):
        def run(prompt, n_new):
            calls.append((name, int(prompt[0, 0])))
            return _FakeResult(torch.cat([prompt, torch.tensor([said[int(prompt[0, 0])]])], 1), 1.0)
        return run

    rows = [experiment.Row("AR", runner("AR")), experiment.Row("a", runner("a"))]
    ids = torch.tensor([[10], [20], [30], [40]])
    tried = experiment.measure_cell(rows, ids, 2, repeats=2, answers=[[7, 8], [7, 8], [5], [7, 8]], wanted=2)
    assert tried == 3
    assert calls == [("AR", 10), ("a", 10), ("AR", 10), ("a", 10), ("AR", 20),
                     ("AR", 30), ("a", 30), ("AR", 30), ("a", 30)]
    assert len(rows[0].taus) == len(rows[1].taus) == 2 and [len(t) for t in rows[1].tpots] == [2, 2]
    records = experiment.cell_records("retrieval", 1, rows)
    for rec in records:
        rec.update(prompts_drawn=tried, prompts_answered=2)
    assert "answered/drawn: 1: 2/3" in cli.format_table(records)
    with pytest.raises(ValueError, match="AR as the first row"):
        experiment.measure_cell(rows[1:], ids, 2, repeats=1, answers=[[7]] * 4)


def test_draft_cutoff_reaches_every_drafter_row(monkeypatch):
    seen = []
    monkeypatch.setattr(spec_decode, "generate", lambda *a, **k: seen.append((k["policy"], k["draft_cutoff"])))
    monkeypatch.setattr(spec_decode, "autoregressive", lambda *a, **k: seen.append(("AR", None)))
    rows = experiment.make_rows("target", "drafter", "anchor", ["dflash", "fold", experiment.ANCHOR_ROW], 64, 2.0,
                                256, draft_cutoff=0.4)
    for row in rows:
        row.run(torch.zeros(1, 4, dtype=torch.long), 2)
    assert seen == [("AR", None), ("dflash", 0.4), ("fold", 0.4), ("dflash", 0.4)]


def test_a_row_runs_the_policy_a_script_gives_it(monkeypatch):
    """make_rows' ``policies`` hook: the named row runs the given policy with no options of its own."""
    seen = []
    monkeypatch.setattr(spec_decode, "generate", lambda *a, **k: seen.append(
        (k["policy"], k.get("far_budget"), k.get("window"))))
    monkeypatch.setattr(spec_decode, "autoregressive", lambda *a, **k: None)
    mine = lambda request: None  # noqa: E731
    rows = experiment.make_rows("target", "drafter", "anchor", ["fold", experiment.BUDGET_ROW], 64, 2.0, 256,
                                far_budget=512, policies={experiment.BUDGET_ROW: mine})
    for row in rows:
        row.run(torch.zeros(1, 4, dtype=torch.long), 2)
    assert seen == [("fold", None, 64), (mine, None, None)]


def test_the_far_budget_diagnostic_watches_the_read_through_a_policy(capsys):
    """benchmarks/far_budget_diagnose.py --check on the toy pair: its watching policy sees the drafter's far
    reads (through fold.spec_decode's public Read, no method replaced) and FOLD's class is untouched."""
    from benchmarks import far_budget_diagnose
    from fold.spec_decode import policies

    call = policies.FoldRead.__call__
    far_budget_diagnose.main(["--check", "--lengths", "400", "--page", "16", "--budget", "64", "--window", "64"])
    reads = int(capsys.readouterr().out.split(" reads,")[0].split()[-1])
    assert reads > 0 and policies.FoldRead.__call__ is call


def test_the_budget_row_is_fold_with_its_far_budget(monkeypatch):
    seen = []
    monkeypatch.setattr(spec_decode, "generate", lambda *a, **k: seen.append(
        (k["policy"], k.get("far_budget"), k.get("far_page"), k.get("window"))))
    monkeypatch.setattr(spec_decode, "autoregressive", lambda *a, **k: None)
    rows = experiment.make_rows("target", "drafter", "anchor", ["fold", experiment.BUDGET_ROW], 64, 2.0, 256,
                                far_budget=512, far_page=32)
    for row in rows:
        row.run(torch.zeros(1, 4, dtype=torch.long), 2)
    assert [r.name for r in rows] == ["AR", "fold", "fold-budget"]
    assert seen == [("fold", None, None, 64), ("fold", 512, 32, 64)]
    assert experiment.BUDGET_ROW in cli.PRESETS["default"]["rows"]
    assert experiment.BUDGET_ROW in cli.REAL_PRESETS["default"]["rows"]


def test_the_budget_row_is_paired_against_fold():
    """The fold-budget row's tau minus FOLD's on the same prompts, with its CI, in the records and the table."""
    taus = {"AR": [1.0, 1.0, 1.0], "window": [1.5, 1.0, 2.0], "fold": [2.0, 3.0, 2.5],
            experiment.BUDGET_ROW: [2.0, 2.5, 2.0]}
    rows = []
    for name, values in taus.items():
        row = experiment.Row(name, None)
        row.taus, row.tpots = values, [[1.0]] * 3
        rows.append(row)
    records = {r["policy"]: r for r in experiment.cell_records("code", 4096, rows)}
    budget = records[experiment.BUDGET_ROW]
    assert budget["tau_minus_fold"] == pytest.approx(-1 / 3, abs=ROUNDED)
    assert budget["tau_minus_fold_ci"] == [round(x, 4) for x in spec_decode.bootstrap_ci([[0.0, -0.5, -0.5]])[1:]]
    assert all("tau_minus_fold" not in r for name, r in records.items() if name != experiment.BUDGET_ROW)
    table = cli.format_table(list(records.values()))
    assert "tau - FOLD (paired; the far budget's cost)" in table and "fold-budget" in table


def test_a_far_budget_too_small_for_the_drafters_block_is_refused(monkeypatch, tmp_path, capsys):
    """Checked against the drafter's block once it is loaded, before any run."""
    drafter = type("D", (), {"cfg": type("C", (), {"rope": fold.Rope.from_theta(1e4, 16), "block_size": 16})()})()
    monkeypatch.setattr(experiment, "load_pair", lambda *a: ("target", drafter, None, None))
    monkeypatch.setattr(experiment, "run_comparison", lambda *a, **k: pytest.fail("nothing may run for a bad budget"))
    with pytest.raises(SystemExit) as info:
        cli.main(["--rows", experiment.BUDGET_ROW, "--far-budget", "64", "--far-page", "64",
                  "--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 2
    assert "far_budget must hold at least 2 pages of far_page=64 entries for a block of 16 rows" in \
        capsys.readouterr().err


def test_the_shipped_pair_is_lossless_with_a_far_budget(pair, held_ids):
    pytest.importorskip("fold.far_pages")
    target, drafter, _, tokenizer = pair
    rng = random.Random(8)
    prompts = [torch.tensor(code_prompt(held_ids, rng, 300)),
               torch.tensor(retrieval_prompt(rng, tokenizer, 400, 200)[0])]
    ids, mask = padded_batch(prompts)
    opts = experiment.policy_options(experiment.BUDGET_ROW, window=32, alpha=2.0, train_len=64, far_budget=64,
                                     far_page=16)
    out = spec_decode.generate(target, drafter, ids, attention_mask=mask, max_new_tokens=12, policy="fold", **opts)
    for b, p in enumerate(prompts):
        expected = greedy_ar(target, p, 12)
        assert torch.equal(out.sequences[b, :len(expected)], expected), f"row {b} differs from the target's greedy"


def test_shift_read_at_zero_equals_the_plain_read(pair):
    _, drafter, _, _ = pair
    rope, cfg = drafter.cfg.rope, drafter.cfg
    torch.manual_seed(0)
    q = torch.randn(1, 8, cfg.heads_q, cfg.head_dim)
    k, v = torch.randn(1, 40, cfg.heads_kv, cfg.head_dim), torch.randn(1, 40, cfg.heads_kv, cfg.head_dim)
    truth, _ = rope_attention_ref(q, k, v, rope=rope)
    same_dtype, _ = rope_attention_ref(q, k, v, rope=rope, upcast=False)
    check_close("shift 0 vs plain read", experiment.shifted_read(rope, 0)(q, k, v, 0), truth, same_dtype, torch.float32)
    # shifted by s: the block's queries and keys at positions s later, i.e. turned by R_s before a plain
    # read (R_s formed in float64 for both the truth and the float32 twin)
    turn = dict(inv_freq=rope.inv_freq, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved)
    q_s = apply_rope(q.double(), torch.tensor(4096), **turn)
    k_s = torch.cat([k[:, :32].double(), apply_rope(k[:, 32:].double(), torch.tensor(4096), **turn)], 1)
    truth, _ = rope_attention_ref(q_s, k_s, v, rope=rope)
    same_dtype, _ = rope_attention_ref(q_s.float(), k_s.float(), v, rope=rope, upcast=False)
    check_close("shift 4096", experiment.shifted_read(rope, 4096)(q, k, v, 0), truth, same_dtype, torch.float32)


@pytest.mark.parametrize("args, words", [
    (["--prompts", "0"], "--prompts: must be >= 1, got 0"),
    (["--new-tokens", "0"], "--new-tokens: must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    (["--lengths", "1024", "0"], "--lengths: must be >= 256, got 0"),
    (["--window", "-1"], "--window: must be >= 8"),
    (["--alpha", "0.5"], "--alpha: must lie in [1, 10000], got 0.5"),
    (["--alpha", "x"], "--alpha: expected a number"),
    (["--draft-cutoff", "1"], "--draft-cutoff: must lie in [0, 1), got 1.0"),
    (["--draft-cutoff", "-0.1"], "--draft-cutoff: must lie in [0, 1), got -0.1"),
    (["--far-budget", "0"], "--far-budget: must be >= 1, got 0"),
    (["--far-page", "0"], "--far-page: must be >= 1, got 0"),
    (["--artifacts", "/nonexistent/pair"], "must hold target/, drafter/, drafter_anchor/"),
])
def test_demo_rejects_bad_options_before_any_work(args, words, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(experiment, "load_pair", lambda *a: pytest.fail("the pair must not load for bad options"))
    with pytest.raises(SystemExit) as info:
        cli.main(args + ["--out", str(tmp_path / "o"), "--no-progress"])
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_demo_checks_out_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(experiment, "load_pair", lambda *a: pytest.fail("the pair must not load for a bad --out"))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as info:
        cli.main(["--out", str(blocker / "sub"), "--no-progress"])
    assert info.value.code == 2 and "is not a writable folder" in capsys.readouterr().err


def test_results_are_written_table_first_and_atomically(tmp_path, monkeypatch):
    """results.json appears only after table.txt (and the plot) of the same records; a failing write
    leaves neither a partial file nor a stale temporary behind."""
    records = [dict(task="code", length=1024, policy=p, tau=t, tau_ci=[t - 0.1, t + 0.1], speedup=1.0,
                    speedup_ci=[0.9, 1.1], lossless=True) for p, t in (("AR", 1.0), ("window", 1.5), ("fold", 2.0))]
    records[2].update(tau_minus_window=0.5, tau_minus_window_ci=[0.2, 0.8])
    order = []
    real_replace = files.os.replace
    monkeypatch.setattr(files.os, "replace", lambda a, b: (order.append(Path(b).name), real_replace(a, b)))
    cli.save_results(records, tmp_path)
    assert order == ["tau_vs_length.png", "table.txt", "results.json"]
    assert json.loads((tmp_path / "results.json").read_text()) == records
    assert "+0.50 [+0.20, +0.80]" in (tmp_path / "table.txt").read_text()

    def broken(path):
        path.write_text("half")
        raise OSError("disk full")
    monkeypatch.setattr(cli, "format_table", lambda records: "new table")
    monkeypatch.setattr(cli, "plot", lambda records, path: broken(path))
    with pytest.raises(OSError, match="disk full"):
        cli.save_results(records[:1], tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == records      # the old, complete results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "table.txt", "tau_vs_length.png"]


def test_results_get_a_plain_files_mode_and_the_plot_the_tables_lengths(tmp_path, plain_mode):
    """Written files are readable as any file the user writes (not mkstemp's 0600), and the plot's
    ticks name the lengths as the table does (2,031, not 1.98K)."""
    import matplotlib

    matplotlib.use("Agg")
    records = [dict(task="code", length=n, policy=p, tau=1.0, tau_ci=[1.0, 1.0], speedup=1.0, speedup_ci=[1.0, 1.0],
                    lossless=True) for n in (2031, 8128) for p in ("AR", "fold")]
    cli.save_results(records, tmp_path)
    for name in ("results.json", "table.txt", "tau_vs_length.png"):
        assert (tmp_path / name).stat().st_mode & 0o777 == plain_mode, name
    seen = []
    real_xticks = matplotlib.axes.Axes.set_xticks

    def spy(self, ticks, labels=None, **kwargs):
        seen.append(list(labels) if labels is not None else None)
        return real_xticks(self, ticks, labels, **kwargs)
    matplotlib.axes.Axes.set_xticks = spy
    try:
        cli.plot(records, tmp_path / "p.png")
    finally:
        matplotlib.axes.Axes.set_xticks = real_xticks
    assert ["2,031", "8,128"] in seen


def test_the_real_pairs_results_go_to_their_own_default_folder(monkeypatch, tmp_path):
    """--real writes into fold-demo-out-real, the toy pair into fold-demo-out (never over each other)."""
    monkeypatch.chdir(tmp_path)
    made = []
    monkeypatch.setattr(cli, "check_writable", lambda out: (made.append(out), (_ for _ in ()).throw(OSError("stop"))))
    for argv, want in ((["--no-progress"], "fold-demo-out"), (["--real", "--no-progress"], "fold-demo-out-real")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert made[-1] == Path(want)
