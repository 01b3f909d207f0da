"""The real drafter's development forms (``fold.demo.natural``): natural text no training source
holds, and prompts cut where the text goes on by repeating a span found only far back."""

import random

import pytest
import torch

from fold.demo import corpus, experiment, forms, natural, tokens


def _ids_with(repeats, n=4000, vocab=50_000, seed=0):
    """Random ids (no 16-gram recurs by chance) with ``repeats``: [(source start, copy start, length)]."""
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(n)]
    for s, c, size in repeats:
        ids[c:c + size] = ids[s:s + size]
    return ids


def test_far_repeats_are_the_starts_of_spans_seen_only_far_back():
    ids = _ids_with([(200, 3100, 40),                     # far: 2,900 back
                     (3300, 3800, 30),                    # near: 500 back
                     (1500, 4000, 20), (1500, 4600, 20),  # the second copy's nearest source is the first, 600 back
                     (500, 4200, 20)], n=6000)            # 3,700 back: outside a 3,000-token prompt
    assert natural.far_repeats(ids, length=3000, min_distance=1000) == [(3100, 200), (4000, 1500)]
    assert natural.far_repeats(ids, length=3000, min_distance=400) == [(3100, 200), (3800, 3300), (4000, 1500),
                                                                       (4600, 4000)]
    assert natural.far_repeats(ids, length=2000, min_distance=1000) == []      # no source inside the prompt


def test_far_repeat_prompts_end_inside_the_repeat_and_answer_its_continuation():
    ids = _ids_with([(100 + 60 * i, 3000 + 60 * i, 24) for i in range(20)], n=4500)
    pairs = natural.far_repeat_prompts(random.Random(0), ids, length=3000, count=12, min_distance=1000)
    assert len(pairs) == 12 and len({tuple(a) for _, a in pairs}) == 12       # distinct repeats
    for prompt, answer in pairs:
        assert len(prompt) == 3000 and len(answer) == natural.ANSWER
        cut = next(c for c in range(3000, len(ids)) if ids[c - 3000:c] == prompt)
        assert ids[cut:cut + natural.ANSWER] == answer
        into = (cut - 3000) % 60                           # tokens of the repeat already in the prompt
        assert 1 <= into <= 4
        source = cut - 2900                                # where the answer stands 2,900 tokens back
        assert ids[source:source + natural.ANSWER] == answer and prompt[-into:] == ids[source - into:source]


def test_far_repeat_prompts_refuse_what_the_text_does_not_hold():
    ids = _ids_with([(100, 2700, 24)])
    with pytest.raises(ValueError, match="1 far repeats at distance >= 1000 in 4000 tokens for 2700-token prompts; 2"):
        natural.far_repeat_prompts(random.Random(0), ids, 2700, 2, 1000)
    assert len(natural.far_repeat_prompts(random.Random(0), ids, 2700, 1, 1000)) == 1
    with pytest.raises(ValueError, match="answer"):
        natural.far_repeat_prompts(random.Random(0), ids, 2700, 1, 1000, span=12, answer=12)
    with pytest.raises(ValueError, match="unknown development form 'poems'"):
        natural.dev_files("poems")
    with pytest.raises(FileNotFoundError, match="development form 'mail'"):
        natural.dev_files("mail", root=corpus.stdlib_dir() / "no-such-folder")


@pytest.mark.parametrize("form", natural.DEV_FORMS)
def test_development_forms_are_natural_text_no_training_source_holds(form):
    """Each form reads real files (the installed Python's and torch's), none of them a file the training
    reads, and no line of it is in the training's code or prose (the check of what training could see)."""
    files = natural.dev_files(form)
    training_files = {f for fs in corpus.package_files().values() for f in fs}
    assert len(files) >= 10 and not training_files & set(files)
    text = natural.dev_text(form, max_chars=200_000)
    assert 50_000 <= len(text) <= 200_000
    sources = _training_sources()
    training = "\n".join([sources.code, sources.tests, sources.docs, *sources.prose])
    # long distinctive lines of the form: none occurs in what the training reads
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) >= 60 and not ln.startswith(("//", "--"))]
    lines = sorted(set(lines), key=lines.index)[:: max(1, len(lines) // 200)]
    assert len(lines) >= 50
    found = [ln for ln in lines if ln in training]
    assert len(found) <= len(lines) // 50, found[:5]       # a license line or two may be shared, no more


_SOURCES = []


def _training_sources():
    if not _SOURCES:
        _SOURCES.append(corpus.training_sources())
    return _SOURCES[0]


@pytest.mark.parametrize("form", natural.DEV_FORMS)
def test_each_development_form_holds_far_repeats_at_4k_and_8k(form):
    """Enough far repeats for a cell (prompts x draws) at each length, with a real tokenizer's granularity
    (the toy BPE of the shipped pair)."""
    import transformers

    import fold.demo

    tok = transformers.AutoTokenizer.from_pretrained(fold.demo.TARGET_DIR)
    ids = tokens.encode(tok, natural.dev_text(form, max_chars=400_000))
    for length in (4096, 8128):
        assert len(natural.far_repeats(ids, length, length // 4)) >= 18


def test_natural_tasks_are_answered_cells_with_their_scope(monkeypatch):
    """A natural cell keeps the prompts whose repeat the target's output goes on with, records answered/drawn
    and its scope, without any held-out text."""
    import transformers

    import fold.demo
    from fold.demo import cli

    tok = transformers.AutoTokenizer.from_pretrained(fold.demo.TARGET_DIR)
    monkeypatch.setattr(natural, "MAX_CHARS", 300_000)
    task, length, wanted = "natural-mail", 2048, 2
    ids, n_new, answers = experiment.prompts_for(task, length, wanted * experiment.RETRIEVAL_DRAWS, 0, {}, tok, 8)
    assert ids.shape == (wanted * experiment.RETRIEVAL_DRAWS, length) and n_new == natural.ANSWER
    answerable = {tuple(ids[i].tolist()): answers[i] for i in (0, 2)}

    class _Result:
        def __init__(self, sequences):
            self.sequences = sequences
            self.stats = dict(per_sequence=[dict(tpot_s=0.01, committed_per_round=[3, 1], rounds=2)])

    def run(prompt, n):
        said = answerable.get(tuple(prompt[0].tolist()), [0] * n)
        return _Result(torch.cat([prompt, torch.tensor([said[:n] + [0] * (n - len(said))])], 1))

    monkeypatch.setattr(experiment, "make_rows",
                        lambda *a, **k: [experiment.Row("AR", run), experiment.Row("fold", run)])
    records = experiment.run_comparison("target", "drafter", None, tok, held_ids={}, tasks=[task], lengths=[length],
                                        rows=["fold"], prompts=wanted, new_tokens=8, repeats=1, window=64, alpha=2.0,
                                        seed=0, train_len=64)
    assert {(r["prompts_answered"], r["prompts_drawn"], r["scope"]) for r in records} == {
        (2, 3, experiment.SCOPES[task])}
    assert "natural-mail: a development form, never trained on" in cli.format_table(records)


# -- the natural training forms ------------------------------------------------------------------------


def test_natural_training_sources_leave_out_the_held_out_and_development_tests():
    tests = corpus.training_tests()
    files = [line[len("# file: "):] for line in tests.splitlines() if line.startswith("# file: test/")]
    assert len(files) >= 300 and "test/test_re.py" in files and "test/test_dataclasses/__init__.py" in files
    for name in files:
        assert not any(word in name for word in corpus.UNTRAINED_TESTS), name
    docs = corpus.training_docs()
    assert "# topic: " in docs and "# file: idlelib/NEWS.txt" in docs and "# file: LICENSE.txt" in docs
    assert corpus.training_tests(corpus.stdlib_dir() / "no-such-folder") == ""


def test_a_natural_sample_is_the_window_with_the_most_far_repeats():
    """``length`` tokens of the text as they are, the best of the windows drawn by the far repeats they hold."""
    import transformers

    import fold.demo

    tok = transformers.AutoTokenizer.from_pretrained(fold.demo.TARGET_DIR)
    text = corpus.training_tests()[:400_000]
    seed, length = 5, 1024
    best = forms.natural_sample(random.Random(seed), tok, text, length, min_distance=256, candidates=4)
    assert len(best) == length and tok.decode(best) in text
    rng, scores, windows = random.Random(seed), [], []
    for _ in range(4):                                  # the same draws one at a time
        ids = forms.natural_sample(rng, tok, text, length, min_distance=256, candidates=1)
        windows.append(ids)
        scores.append(sum(c - s >= 256 for c, s in natural.repeat_starts(ids, forms.NATURAL_SPAN)))
    assert best == windows[scores.index(max(scores))] and len(set(scores)) > 1
    with pytest.raises(ValueError, match="form 'natural-tests': its source text is empty"):
        forms.natural_text("natural-tests", corpus.TrainingSources("code", ["prose"]))
