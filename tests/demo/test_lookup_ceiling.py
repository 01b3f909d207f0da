"""tools.lookup_ceiling: a suffix-lookup drafter played on a run's own prompts."""

import pytest
import transformers

from fold.demo import experiment
from tests.demo.test_compare_runs import records as records_of
from tools import lookup_ceiling
from tools.lookup_ceiling import lookup_draft, lookup_rounds

TOY_TOKENIZER = experiment.__file__.rsplit("/", 1)[0] + "/artifacts/target"


def test_the_draft_follows_the_longest_suffix_then_the_latest_occurrence():
    #       0  1  2  3  4  5  6  7  8  9 10 11 12 13
    ids = [9, 5, 6, 1, 2, 3, 5, 6, 7, 8, 4, 9, 5, 6]
    # [9, 5, 6] (three tokens) occurs only at the start, though [5, 6] occurs later too
    assert lookup_draft(ids, 0, len(ids), 3) == [1, 2, 3]
    # without the start, the latest [5, 6] (ending at 8, the token after it 7)
    assert lookup_draft(ids, 4, len(ids), 3) == [7, 8, 4]
    # two occurrences of the longest suffix: the latest one's continuation
    assert lookup_draft([5, 6, 1, 5, 6, 2, 0, 5, 6], 0, 9, 3) == [2, 0, 5]
    # j, the index after an occurrence, must lie in [lo, hi): lo = 4 drops the start's (j = 3),
    # hi = 8 the later [5, 6] (j = 8), and lo = 3 keeps the start's
    assert lookup_draft(ids, 4, 8, 2) == []
    assert lookup_draft(ids, 4, 9, 2) == [7, 8]
    assert lookup_draft(ids, 3, 8, 2) == [1, 2]
    # the draft stops where the sequence does; no occurrence of even the last token: nothing
    assert lookup_draft([1, 2, 1], 0, 3, 5) == [2, 1]
    assert lookup_draft([1, 2, 3], 0, 3, 5) == []


def far_prompt(gap):
    """A 16-token span, ``gap`` filler tokens no span token is among, then the span's first two tokens."""
    span = list(range(100, 116))
    filler = [1000 + i for i in range(gap)]
    return span + filler + span[:2], span[2:14]


def test_rounds_copy_a_far_span_only_through_the_far_reader():
    prompt, answer = far_prompt(gap=300)                       # the span sits more than W + block back
    assert lookup_rounds(prompt, answer, window=256, block=8, reader="far") == [8, 4]
    assert lookup_rounds(prompt, answer, window=256, block=8, reader="window") == [1] * 12
    assert lookup_rounds(prompt, answer, window=256, block=8, reader="all") == [8, 4]
    prompt, answer = far_prompt(gap=200)                       # inside the last W + block: the window's
    assert lookup_rounds(prompt, answer, window=256, block=8, reader="window") == [8, 4]
    assert lookup_rounds(prompt, answer, window=256, block=8, reader="far") == [1] * 12
    assert lookup_rounds(prompt, answer, window=256, block=8, reader="all") == [8, 4]
    # the edge: the token after the far occurrence (index 2) is far while 2 < len(prompt) - (W + block)
    for gap, far in ((249, True), (248, False)):
        prompt, answer = far_prompt(gap)
        assert lookup_rounds(prompt, answer, window=256, block=8, reader="far")[0] == (8 if far else 1), gap
        assert lookup_rounds(prompt, answer, window=256, block=8, reader="window")[0] == (1 if far else 8), gap
    # a wrong draft is cut at the first mismatch, and the target's token follows
    prompt, answer = far_prompt(gap=300)
    assert lookup_rounds(prompt, answer[:3] + [7] + answer[4:], window=256, block=8, reader="far")[0] == 4
    with pytest.raises(ValueError, match="reader"):
        lookup_rounds(prompt, answer, window=256, block=8, reader="both")


@pytest.fixture(scope="module")
def toy_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOY_TOKENIZER)


def test_a_run_is_matched_by_digest_and_each_prompt_played(toy_tokenizer):
    task, length = "natural-mail", 512
    ids, _, answers = experiment.prompts_for(task, length, 2 * experiment.RETRIEVAL_DRAWS, 0, None, toy_tokenizer, 1)
    picked = [4, 1, 5]                                         # the prompts the target "answered"
    digests = [experiment.prompt_digest(ids[i]) for i in picked]
    records = records_of({"AR": [1.0] * 3, "window": [1.0, 1.5, 1.0], "fold": [2.0, 1.5, 1.5]}, digests, task, length)
    records += records_of({"AR": [1.0], "window": [1.0]}, digests[:1], "code", length)
    (row,) = lookup_ceiling.ceiling(records, toy_tokenizer, None, prompts=2, seed=0, window=64, block=8)
    want = {reader: [lookup_rounds(ids[i].tolist(), answers[i], window=64, block=8, reader=reader) for i in picked]
            for reader in ("far", "window", "all")}
    assert (row["task"], row["length"], row["n"]) == (task, length, 3)
    for reader, rounds in want.items():
        assert row[f"tau_{reader}"] == round(sum(sum(r) / len(r) for r in rounds) / 3, 2)
    assert row["far_full_first_round"] == sum(r[0] == 8 for r in want["far"])
    assert row["all_minus_window"] == round(sum(sum(a) / len(a) - sum(w) / len(w)
                                                for a, w in zip(want["all"], want["window"])) / 3, 2)
    assert row["run_fold_minus_window"] == round((1.0 + 0.0 + 0.5) / 3, 2)
    # prompts drawn with another --prompts are not the run's: refused, naming the option
    with pytest.raises(ValueError, match="--prompts 3"):
        lookup_ceiling.ceiling(records, toy_tokenizer, None, prompts=3, seed=0, window=64, block=8)


def test_the_command_refuses_a_folder_without_results_and_bad_options(tmp_path, capsys):
    assert lookup_ceiling.main([str(tmp_path), "--tokenizer", TOY_TOKENIZER]) == 2
    assert "no fold-demo results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lookup_ceiling.main([str(tmp_path), "--block", "1"])
    assert "--block must be at least 2" in capsys.readouterr().err
