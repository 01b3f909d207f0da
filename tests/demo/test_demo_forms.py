"""The real drafter's training forms and the held-out retrieval forms (``fold.demo.forms``,
``fold.demo.prompts``): each document copies what it says it copies, the evaluation's values cannot
come out of a training form, and the held-out prompts store their value far back and ask for it at
the end."""

import json
import random
import re

import pytest
import torch
import transformers

from fold.demo import corpus, forms, prompts, real, tokens


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
NEUTRAL = ("parser", "token", "buffer", "value", "method", "object", "returns", "reads", "writes", "calls", "list",
           "given", "each", "when", "field", "queue", "stream", "result", "handler", "state", "number", "entry")


def _sentence(rng):
    words = [rng.choice(NEUTRAL) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + "."


def _module(rng, name, n):
    """A module with a docstring, commented functions with docstrings, and a doctest (not prose)."""
    parts = [f'"""{_sentence(rng)} {_sentence(rng)}\n\n{_sentence(rng)} {_sentence(rng)}\n"""\n\n']
    for i in range(n):
        parts.append(f"# {_sentence(rng)}\n# {_sentence(rng)}\ndef {name}_{i}(x):\n"
                     f'    """{_sentence(rng)} {_sentence(rng)}\n\n    >>> {name}_{i}(1)\n    2\n    """\n'
                     f"    y = x + {i}\n    return y * {rng.randint(1, 9)}\n\n")
    return "".join(parts)


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    """A source tree shaped like the standard library, with prose in docstrings and comments, the
    language reference topics and a license; its words share nothing with the evaluation's lexicons."""
    root = tmp_path_factory.mktemp("stdlib")
    rng = random.Random(0)
    for name in ("alpha", "beta", "gamma"):
        (root / f"{name}.py").write_text(_module(rng, name, 60))
    for pkg in corpus.HELD_OUT:
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text(_module(rng, pkg, 40))
    (root / "pydoc_data").mkdir()
    topics = {f"topic{i}": f"{_sentence(rng)} {_sentence(rng)}\n\n{_sentence(rng)} {_sentence(rng)}" for i in range(20)}
    (root / "pydoc_data" / "topics.py").write_text(f"topics = {topics!r}\n")
    (root / "LICENSE.txt").write_text("\n\n".join(f"{_sentence(rng)} {_sentence(rng)}" for _ in range(5)))
    return root


@pytest.fixture(scope="module")
def sources(stdlib):
    return corpus.training_sources(stdlib)


@pytest.fixture(scope="module")
def held_prose(stdlib):
    return corpus.prose_paragraphs("".join(corpus.held_out_code(stdlib).values()))


def _render(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.fixture(scope="module")
def tokenizer(sources, held_prose, tmp_path_factory):
    rng = random.Random(1)
    texts = [sources.code, "\n".join(held_prose), " ".join(prompts.HELD_OUT_LEXICON + forms.TRAIN_WORDS)]
    texts += [forms.training_document(rng, form, sources, 3000, _render)[0] for form in forms.TRAINING_FORMS]
    path = tmp_path_factory.mktemp("tok")
    tokens.save_tokenizer(tokens.train_tokenizer(texts, 600), path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    return tok


# -- lexicons --------------------------------------------------------------------------------------------

EVAL_WORDS = re.compile(r"\b(" + "|".join(w for w in prompts.HELD_OUT_LEXICON if len(w) >= 4) + r")\b", re.I)
PLANT_VALUE = re.compile(r"\b(" + "|".join(prompts.PLANT_WORDS) + r")-(" + "|".join(prompts.PLANT_WORDS) + r")-\d\d\b")


def test_training_and_evaluation_lexicons_are_disjoint():
    train = {w.lower() for w in forms.TRAIN_WORDS + forms.TRAIN_NAMES}
    held_out = {w.lower() for w in prompts.HELD_OUT_LEXICON}
    assert set(prompts.PLANT_WORDS) <= held_out and len(train) == len(forms.TRAIN_WORDS) + len(forms.TRAIN_NAMES)
    assert not train & held_out, sorted(train & held_out)


def test_no_training_form_writes_an_evaluation_value_or_template(sources):
    for form in forms.TRAINING_FORMS:
        for seed in range(25):
            text, _ = forms.training_document(random.Random(seed), form, sources, 3000, _render)
            assert EVAL_WORDS.search(text) is None, (form, EVAL_WORDS.search(text))
            assert re.search(prompts.TRACKING_PATTERN, text) is None and PLANT_VALUE.search(text) is None, form
            assert not [cue for cue in prompts.HELD_OUT_CUES if cue in text], form
    rng = random.Random(0)
    for _ in range(3000):                    # the value formats alone: none is a tracking number or a plant
        for value in (forms.train_value(rng), forms.random_id(rng)):
            assert not re.fullmatch(prompts.TRACKING_PATTERN[2:-2], value) and not PLANT_VALUE.search(value), value


def test_the_value_detectors_find_every_evaluation_value(tokenizer, held_prose, stdlib):
    """The checks above can fail: they find the values of each evaluation prompt."""
    rng = random.Random(3)
    email, _ = prompts.email_retrieval_prompt(rng, tokenizer, held_prose, 2400, 1200)
    minutes, _ = prompts.minutes_retrieval_prompt(rng, tokenizer, held_prose, 2400, 1200)
    planted, _ = prompts.planted_retrieval_prompt(rng, tokenizer, corpus.held_out_code(stdlib), 2400, 1200)
    assert re.search(prompts.TRACKING_PATTERN, tokenizer.decode(email)) and EVAL_WORDS.search(tokenizer.decode(email))
    assert EVAL_WORDS.search(tokenizer.decode(minutes)) and "will be held at" in tokenizer.decode(minutes)
    assert PLANT_VALUE.search(tokenizer.decode(planted))


# -- training forms ------------------------------------------------------------------------------------

def test_prose_comes_from_docstrings_comments_the_reference_and_the_license(stdlib, sources):
    code = (stdlib / "alpha.py").read_text()
    paras = corpus.prose_paragraphs(corpus.read_files([stdlib / "alpha.py"], stdlib))
    module_doc = code.split('"""')[1].split("\n\n")[0].strip()
    comment = " ".join([line[2:] for line in code.splitlines() if line.startswith("# ")][:2])
    assert paras[0] == module_doc and comment in paras
    assert not [p for p in paras if ">>>" in p or "return y" in p]              # no doctest, no code
    reference = corpus.reference_prose(stdlib)
    assert len(reference) == 20 * 2 + 5 and reference[-1] in (stdlib / "LICENSE.txt").read_text()
    assert set(reference) <= set(sources.prose)
    held = corpus.prose_paragraphs("".join(corpus.held_out_code(stdlib).values()))
    assert held and not set(held) & set(sources.prose)                # held-out prose is never a training source


@pytest.mark.parametrize("form", forms.TRAINING_FORMS)
def test_each_training_form_copies_what_it_reports_and_copy_mask_marks_it(form, sources, tokenizer):
    """Every reported copy occurs earlier and again later; :func:`tokens.copy_mask` (matches of up to 8
    tokens) marks nearly every token of the later occurrences past their first two."""
    marked = total = 0
    for seed in range(6):
        text, copied = forms.training_document(random.Random(seed), form, sources, 2500, _render)
        assert copied, form
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = tokens.copy_mask(torch.tensor([enc.input_ids]), max_order=8)[0]
        for c in copied:
            first = text.find(c)
            later = text.find(c, first + 1)
            assert first >= 0 and later >= first + len(c), (form, c)
            while later >= 0:
                inner = [k for k, (a, b) in enumerate(enc.offset_mapping) if a >= later and b <= later + len(c)][2:]
                marked, total = marked + int(mask[inner].sum()), total + len(inner)
                later = text.find(c, later + 1)
    assert total > 0 and marked >= 0.9 * total, (form, marked, total)


def test_code_form_is_held_in_code_with_its_lines_recurring(sources):
    lines_of_code = set(sources.code.split("\n"))
    for seed in range(10):
        text, copied = forms.code_repeats_document(random.Random(seed), sources.code, 3000)
        assert set(text.split("\n")[:-1]) <= lines_of_code                 # nothing but real lines
        assert "# file: asyncio" not in text and copied


def test_planted_form_uses_training_words_only(sources):
    text, planted = forms.planted_document(random.Random(5), sources.code, 3000)
    lines = text.split("\n")
    for line in planted:
        key, value = re.fullmatch(r'SECRET_([A-Z]+)_\d{4} = "([a-z]+-[a-z]+)-\d\d"', line).groups()
        assert key.lower() in forms.TRAIN_WORDS and set(value.split("-")) <= set(forms.TRAIN_WORDS)
        first, last = lines.index(line), len(lines) - 1 - lines[::-1].index(line)
        assert lines.count(line) == 2 and first < len(lines) // 2 + len(planted) <= last


def test_form_sample_has_the_length_and_refuses_what_it_cannot_render(sources, tokenizer):
    for form in forms.TRAINING_FORMS:
        ids = forms.form_sample(random.Random(0), tokenizer, form, sources, 300)
        assert len(ids) == 300 and ids == forms.form_sample(random.Random(0), tokenizer, form, sources, 300)
    chat = tokenizer.decode(forms.form_sample(random.Random(0), tokenizer, "chat", sources, 512))
    assert chat.startswith("<|im_start|>") and "<|im_start|>assistant" in chat
    bare = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    with pytest.raises(ValueError, match="chat template"):
        forms.form_sample(random.Random(0), bare, "chat", sources, 300)
    with pytest.raises(ValueError, match="unknown training form 'poems'"):
        forms.training_document(random.Random(0), "poems", sources, 300)


# -- held-out retrieval forms --------------------------------------------------------------------------

def _check_far_question(tokenizer, prompt, answer, length, cue):
    """The prompt has ``length`` tokens and ends with ``cue``; the answer's tokens occur once earlier in
    it, at least half the prompt back. Returns the decoded answer."""
    assert len(prompt) == length and tokenizer.decode(prompt).endswith(cue)
    starts = [i for i in range(len(prompt) - len(answer) + 1) if prompt[i:i + len(answer)] == answer]
    assert len(starts) == 1 and len(prompt) - starts[0] >= length // 2, starts
    return tokenizer.decode(answer)


@pytest.mark.parametrize("length", [2000, 3000])
def test_email_prompt_asks_for_a_tracking_number_stored_far_back(tokenizer, held_prose, length):
    for seed in range(4):
        prompt, answer = prompts.email_retrieval_prompt(random.Random(seed), tokenizer, held_prose, length, length // 2)
        value = _check_far_question(tokenizer, prompt, answer, length, "the tracking number is")
        assert re.fullmatch(" " + prompts.TRACKING_PATTERN, value) and value[1:3] in prompts.TRACKING_PREFIXES
        text = tokenizer.decode(prompt)
        assert f"The tracking number is{value}," in text and text.count("Subject: Re:") >= 2


@pytest.mark.parametrize("length", [2000, 3000])
def test_minutes_prompt_asks_for_a_venue_stored_far_back(tokenizer, held_prose, length):
    for seed in range(4):
        prompt, answer = prompts.minutes_retrieval_prompt(random.Random(seed), tokenizer, held_prose, length,
                                                       length // 2)
        value = _check_far_question(tokenizer, prompt, answer, length, "will be held at")
        place, kind, number, street, way = re.fullmatch(r" (\w+) (\w+), (\d+) (\w+) (\w+)", value).groups()
        assert (place, kind, street, way) in [(p, k, s, w) for p in prompts.VENUE_PLACES for k in prompts.VENUE_KINDS
                                              for s in prompts.VENUE_STREETS for w in prompts.VENUE_WAYS]
        assert tokenizer.decode(prompt).count("## Decisions") >= 2


@pytest.mark.parametrize("form", sorted(prompts.HELD_OUT_FORMS))
def test_held_out_forms_refuse_a_distance_they_cannot_keep(form, tokenizer, held_prose):
    with pytest.raises(ValueError, match="too short to store a value"):
        prompts.HELD_OUT_FORMS[form](random.Random(0), tokenizer, held_prose, 1200, 1190)


@pytest.mark.skipif(not real.is_converted(real.default_target_dir()), reason="the real target is not converted here")
@pytest.mark.parametrize("form", sorted(prompts.HELD_OUT_FORMS))
def test_held_out_forms_with_the_real_tokenizer(form):
    tok = transformers.AutoTokenizer.from_pretrained(real.default_target_dir())
    prose = corpus.prose_paragraphs("".join(corpus.held_out_code().values()))
    cue = {"email": "the tracking number is", "minutes": "will be held at"}[form]
    for length in (2048, 8128):
        prompt, answer = prompts.HELD_OUT_FORMS[form](random.Random(length), tok, prose, length, length // 2)
        _check_far_question(tok, prompt, answer, length, cue)


# -- the real drafter's feature caches and their weights (examples/train_real_drafter.py) ------------------

@pytest.fixture(scope="module")
def tiny_target(tokenizer, tmp_path_factory):
    from tests.spec_decode_fixtures import make_target

    return make_target("llama", tmp_path_factory.mktemp("target"), vocab=len(tokenizer))


@pytest.fixture
def fake_real_target(monkeypatch, tiny_target, tokenizer):
    """``fold.demo.real.load_target`` answers with the tiny Llama target and the tiny tokenizer."""
    monkeypatch.setattr(real, "load_target", lambda *args, **kwargs: (tiny_target, tokenizer))


def _extract(cache, stdlib, form, shards, seq_len=64, first=0):
    from examples import train_real_drafter

    train_real_drafter.main(["extract", "--form", form, "--cache", str(cache), "--max-shards", str(shards),
                             "--seq-len", str(seq_len), "--shard-size", "2", "--batch", "2", "--taps", "0", "2",
                             "--stdlib", str(stdlib), "--threads", "1", "--first-shard", str(first)])
    return json.loads((cache / "meta.json").read_text())


def test_extract_caches_one_form_per_folder_resumably(fake_real_target, stdlib, tmp_path, monkeypatch):
    from examples import train_real_drafter
    from safetensors.torch import load_file

    meta = _extract(tmp_path / "a", stdlib, "strings", 1, 256)
    assert (meta["form"], meta["copy_max_order"], meta["shards"]) == ("strings", 8, 1)
    meta = _extract(tmp_path / "a", stdlib, "strings", 2, 256)           # resumed: writes shard 1 only
    assert meta["shards"] == 2 and [e["shards_written"] for e in meta["log"]] == [1, 1]
    _extract(tmp_path / "b", stdlib, "strings", 2, 256)                  # uninterrupted
    resumed, straight = (load_file(str(train_real_drafter.shard_path(tmp_path / c, 1))) for c in ("a", "b"))
    assert resumed.keys() == straight.keys() == {"ids", "features", "greedy", "copy"}
    assert all(torch.equal(resumed[k], straight[k]) for k in resumed)
    assert _extract(tmp_path / "c", stdlib, "strings", 2, 256, first=1)["shards"] == 1   # shard 1 alone, the same
    assert [p.name for p in train_real_drafter.existing_shards(tmp_path / "c")] == ["shard_00001.safetensors"]
    late = load_file(str(train_real_drafter.shard_path(tmp_path / "c", 1)))
    assert all(torch.equal(late[k], straight[k]) for k in late)
    with pytest.raises(SystemExit, match="--first-shard 2 must be below --max-shards 2"):
        _extract(tmp_path / "c", stdlib, "strings", 2, 256, first=2)
    assert resumed["features"].shape == (2, 256, 2 * 64) and resumed["features"].dtype == torch.bfloat16
    longest = tokens.copy_mask(resumed["ids"].long(), max_order=8)         # random ids: unlike the latest-pair mask
    assert torch.equal(resumed["copy"].bool(), longest)
    assert not torch.equal(longest, tokens.copy_mask(resumed["ids"].long()))
    other = load_file(str(train_real_drafter.shard_path(tmp_path / "a", 0)))
    with pytest.raises(SystemExit, match="other settings .*'form': \\('strings', 'prose'\\)"):
        _extract(tmp_path / "a", stdlib, "prose", 3, 256)                     # a cache holds one form
    assert torch.equal(load_file(str(train_real_drafter.shard_path(tmp_path / "a", 0)))["ids"], other["ids"])
    monkeypatch.setenv("FOLD_CACHE", str(tmp_path / "home"))
    assert train_real_drafter.parse_args(["extract", "--form", "chat"]).cache == tmp_path / "home" / "real-features-chat"


def _fake_cache(path, rows_per_shard, token, length=16):
    from safetensors.torch import save_file

    path.mkdir()
    for i, rows in enumerate(rows_per_shard):
        save_file(dict(ids=torch.full((rows, length), token, dtype=torch.int32),
                       features=torch.full((rows, length, 4), float(token)).bfloat16(),
                       greedy=torch.full((rows, length), token, dtype=torch.int32),
                       copy=torch.zeros(rows, length, dtype=torch.uint8)),
                  str(path / f"shard_{i:05d}.safetensors"))
    return path


def test_caches_of_several_lengths_give_batches_of_one_length(tmp_path):
    """Natural forms are cached longer than the documents: a batch draws its cache once (by weight), takes
    that cache's rows at their length, and its anchors and positions follow that length."""
    import argparse

    from examples import train_real_drafter

    caches = [_fake_cache(tmp_path / "a", [3], 1, 16), _fake_cache(tmp_path / "b", [2, 2], 2, 64),
              _fake_cache(tmp_path / "c", [2], 3, 16)]
    pool = train_real_drafter.CachedFeatures(caches, [0], hidden=4)
    assert pool.mixed and pool.ranges == [(0, 3), (3, 7), (7, 9)] and pool.seq_lens == [16, 64, 16]
    assert sorted(pool.groups) == [16, 64] and pool.groups[16]["ids"].shape == (5, 16)
    length, rows = pool.take([7, 0, 8])
    assert length == 16 and rows["ids"][:, 0].tolist() == [3, 1, 3] and rows["features"][:, 0, 0].tolist() == [3, 1, 3]
    with pytest.raises(ValueError, match=r"lengths \[16, 64\]; a batch takes one length"):
        pool.take([0, 3])
    rng = random.Random(0)
    drawn = [pool.sample(rng, 4, [1, 2, 1]) for _ in range(3000)]
    assert all(len({pool.cache_of(r) for r in rows}) == 1 for rows in drawn)
    share = sum(pool.cache_of(rows[0]) == 1 for rows in drawn) / len(drawn)
    assert abs(share - 0.5) < 0.04, share
    assert {pool.cache_of(r) for rows in drawn for r in rows} == {0, 1, 2}
    args = argparse.Namespace(batch=2, cache_weights=[0, 1, 0], seq_len=16, block_size=4, blocks=3, min_context=2,
                              copy_anchors=0.0)
    (ids, features, anchors, labels, is_copy, positions), sources = train_real_drafter.batch_inputs(
        pool, rng, args, torch.device("cpu"))
    assert ids.shape == (2, 64) and features.shape == (2, 64, 4) and positions.shape == (2, 68)
    assert sources == [1, 1] and anchors.max() > 16 - 4 and args.seq_len == 16


def test_cache_weights_choose_each_row_s_cache(tmp_path):
    from examples import train_real_drafter

    caches = [_fake_cache(tmp_path / "a", [3], 1), _fake_cache(tmp_path / "b", [2, 2], 2), _fake_cache(tmp_path / "c", [], 3)]
    pool = train_real_drafter.CachedFeatures(caches, [0], hidden=4)
    assert pool.ranges == [(0, 3), (3, 7), (7, 7)]
    rng = random.Random(0)
    uniform = pool.sample(rng, 7)
    assert sorted(uniform) == list(range(7))                               # no weights: distinct rows, all caches
    assert set(pool.ids[pool.sample(rng, 200, [1, 0, 0]), 0].tolist()) == {1}
    assert set(pool.ids[pool.sample(rng, 200, [0, 1, 0]), 0].tolist()) == {2}
    share = (pool.ids[pool.sample(rng, 4000, [3, 1, 0]), 0] == 1).float().mean().item()
    assert abs(share - 0.75) < 0.03, share
    with pytest.raises(ValueError, match=r"none to a cache without sequences \(caches \[2\]\)"):
        pool.sample(rng, 4, [1, 1, 1])
    with pytest.raises(ValueError, match="one weight per cache"):
        pool.sample(rng, 4, [1, 1])


@pytest.mark.parametrize("weights, words", [(["1"], "one weight >= 0 per --cache (2)"), (["1", "-1"], "got [1.0, -1.0]"),
                                            (["0", "0"], "not all 0"), (["1", "inf"], "got [1.0, inf]")])
def test_train_refuses_bad_cache_weights(weights, words, tmp_path, capsys):
    from examples import train_real_drafter

    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "meta.json").write_text("{}")
    with pytest.raises(SystemExit):
        train_real_drafter.parse_args(["train", "--cache", str(tmp_path / "a"), str(tmp_path / "b"), "--out",
                                       str(tmp_path / "o"), "--cache-weights", *weights])
    assert words in capsys.readouterr().err


def test_a_sitting_over_weighted_form_caches_is_logged(fake_real_target, stdlib, tokenizer, tmp_path, capsys):
    """Two form caches, weighted 0.7 / 0.3: two steps, the sitting's log names each cache's form, size and
    weight, and inspect_real_features.py's copy split reads the new shards."""
    from examples import inspect_real_features
    from examples import train_real_drafter

    for form in ("strings", "chat"):
        _extract(tmp_path / form, stdlib, form, 1)
    out = tmp_path / "drafter"
    log = train_real_drafter.main(["train", "--cache", str(tmp_path / "strings"), str(tmp_path / "chat"),
                                   "--cache-weights", "0.7", "0.3", "--out", str(out), "--total-steps", "2",
                                   "--batch", "2", "--blocks", "4", "--block-size", "4", "--layers", "1",
                                   "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--intermediate", "64",
                                   "--mask-token-id", str(len(tokenizer) - 1), "--eval-prompts", "0",
                                   "--stdlib", str(stdlib), "--threads", "1"])
    assert log["total_steps"] == 2
    caches = log["sittings"][-1]["caches"]
    assert [(c["form"], c["sequences"], c["weight"]) for c in caches] == [("strings", 2, 0.7), ("chat", 2, 0.3)]
    assert json.loads((out / "train_log.json").read_text())["sittings"][-1]["caches"] == caches
    inspect_real_features.main(["copy", "--drafter", str(out), "--shard",
                                str(train_real_drafter.shard_path(tmp_path / "chat", 0))])
    assert "long copies" in capsys.readouterr().out


# -- fold-demo --real's retrieval cells ------------------------------------------------------------------

class _Result:
    def __init__(self, sequences):
        self.sequences = sequences
        self.stats = dict(per_sequence=[dict(tpot_s=0.01, committed_per_round=[3, 1], rounds=2)])


def test_real_retrieval_cells_keep_the_answered_prompts_of_each_form(tokenizer, stdlib, monkeypatch):
    """Per retrieval task (the training format and each held-out form) a cell keeps the first prompts
    whose stored value the target's output begins with, and records and prints answered/drawn and
    the cell's scope; the code cell runs every prompt and carries neither."""
    from fold.demo import cli, experiment

    held_text = corpus.held_out_code(stdlib)
    held_ids = {name: tokens.encode(tokenizer, text) for name, text in held_text.items()}
    tasks, length, wanted = ["code", "retrieval", *experiment.HELD_OUT_TASKS], 2000, 2
    answerable = {}                                       # prompt -> the value the fake target "retrieves"
    for task in tasks[1:]:
        ids, _, answers = experiment.prompts_for(task, length, wanted * experiment.RETRIEVAL_DRAWS, 0, held_ids,
                                                 tokenizer, 8, held_text)
        for i in (1, 3):                                   # the 2nd and 4th drawn are answered: 4 drawn for 2
            answerable[tuple(ids[i].tolist())] = answers[i]

    def run(prompt, n_new):
        said = answerable.get(tuple(prompt[0].tolist()), [0] * n_new)
        return _Result(torch.cat([prompt, torch.tensor([said[:n_new] + [0] * (n_new - len(said))])], 1))

    monkeypatch.setattr(experiment, "make_rows",
                        lambda *a, **k: [experiment.Row("AR", run), experiment.Row("fold", run)])
    saved = []                                            # on_cell: the records so far, after each cell
    records = experiment.run_comparison("target", "drafter", None, tokenizer, held_ids=held_ids, tasks=tasks,
                                        lengths=[length], rows=["fold"], prompts=wanted, new_tokens=8, repeats=1,
                                        window=64, alpha=2.0, seed=0, train_len=64, held_text=held_text,
                                        on_cell=lambda done: saved.append(list(done)))
    assert [len(s) for s in saved] == [2 * (i + 1) for i in range(len(tasks))] and saved[-1] == records
    for task in tasks:
        recs = [r for r in records if r["task"] == task]
        assert [r["policy"] for r in recs] == ["AR", "fold"] and all(r["n_prompts"] == wanted for r in recs)
        if task == "code":
            assert not {"scope", "prompts_drawn"} & set(recs[0])
            continue
        assert {(r["prompts_answered"], r["prompts_drawn"], r["scope"]) for r in recs} == {
            (2, 4, experiment.SCOPES[task])}
    table = cli.format_table(records)
    assert "retrieval: in the drafter's training format" in table
    for task in experiment.HELD_OUT_TASKS:
        assert f"{task}: held out from the drafter's training" in table and f"{task}: measured on" in table
    assert table.count(f"answered/drawn: {length}: 2/4") == 3


def test_held_out_tasks_need_the_held_out_text_and_the_real_pair(tokenizer, capsys, monkeypatch, tmp_path):
    from fold.demo import cli, experiment

    with pytest.raises(ValueError, match="needs held_text"):
        experiment.prompts_for("retrieval-email", 2000, 1, 0, {}, tokenizer, 8)
    with pytest.raises(ValueError, match="unknown task 'retrieval-poems'"):
        experiment.prompts_for("retrieval-poems", 2000, 1, 0, {}, tokenizer, 8, {})
    assert set(experiment.HELD_OUT_TASKS) == {f"retrieval-{form}" for form in prompts.HELD_OUT_FORMS} \
        == set(experiment.SCOPES) - {"retrieval", *experiment.NATURAL_TASKS}
    monkeypatch.setattr(experiment, "load_pair", lambda *a: pytest.fail("the pair must not load for bad options"))
    with pytest.raises(SystemExit) as info:
        cli.main(["--tasks", "code", "retrieval-minutes", "--out", str(tmp_path), "--no-progress"])
    assert info.value.code == 2 and "--tasks retrieval-minutes go with --real" in capsys.readouterr().err


def test_train_refuses_a_cache_made_before_forms(fake_real_target, stdlib, tmp_path):
    """An old cache (--mix / --planted, whose planted lines drew PLANT_WORDS) is refused before any step."""
    from examples import train_real_drafter

    _extract(tmp_path / "new", stdlib, "code", 1)
    old = _fake_cache(tmp_path / "old", [2], 1)
    (old / "meta.json").write_text(json.dumps(dict(taps=[0, 2], seq_len=64, mix=[0.3, 0.3, 0.2, 0.2], planted=1.0)))
    with pytest.raises(SystemExit, match=r"\['.*old'\] were extracted before --form"):
        train_real_drafter.main(["train", "--cache", str(tmp_path / "new"), str(old), "--out", str(tmp_path / "o"),
                                 "--stdlib", str(stdlib)])
    assert not (tmp_path / "o").exists()


def test_a_fresh_optimizer_warms_up_again_after_resuming_from_weights():
    from examples import train_real_drafter

    schedule = train_real_drafter.Schedule(lr=1e-3, min_lr=0.1, warmup=30, start=0, total=20000)
    full = schedule.at(10000)                                                  # a checkpoint's optimizer: no warm-up
    assert schedule.at(10000, rewarm=10000) == pytest.approx(full / 30)
    assert schedule.at(10029, rewarm=10000) == pytest.approx(schedule.at(10029))