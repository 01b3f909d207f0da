"""The real drafter's training forms (``fold.demo.data``): each document copies what it says it copies."""

import random
import re

import pytest
import torch
import transformers

from fold.demo import data


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
    for pkg in data.HELD_OUT:
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text(_module(rng, pkg, 40))
    (root / "pydoc_data").mkdir()
    topics = {f"topic{i}": f"{_sentence(rng)} {_sentence(rng)}\n\n{_sentence(rng)} {_sentence(rng)}" for i in range(20)}
    (root / "pydoc_data" / "topics.py").write_text(f"topics = {topics!r}\n")
    (root / "LICENSE.txt").write_text("\n\n".join(f"{_sentence(rng)} {_sentence(rng)}" for _ in range(5)))
    return root


@pytest.fixture(scope="module")
def sources(stdlib):
    return data.training_sources(stdlib)


def _render(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.fixture(scope="module")
def tokenizer(sources, tmp_path_factory):
    rng = random.Random(1)
    texts = [sources.code, " ".join(data.PLANT_WORDS + data.TRAIN_WORDS)]
    texts += [data.training_document(rng, form, sources, 3000, _render)[0] for form in data.TRAINING_FORMS]
    path = tmp_path_factory.mktemp("tok")
    data.save_tokenizer(data.train_tokenizer(texts, 600), path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    return tok


# -- training forms ------------------------------------------------------------------------------------

def test_prose_comes_from_docstrings_comments_the_reference_and_the_license(stdlib, sources):
    code = (stdlib / "alpha.py").read_text()
    paras = data.prose_paragraphs(data.read_files([stdlib / "alpha.py"], stdlib))
    module_doc = code.split('"""')[1].split("\n\n")[0].strip()
    comment = " ".join([line[2:] for line in code.splitlines() if line.startswith("# ")][:2])
    assert paras[0] == module_doc and comment in paras
    assert not [p for p in paras if ">>>" in p or "return y" in p]              # no doctest, no code
    reference = data.reference_prose(stdlib)
    assert len(reference) == 20 * 2 + 5 and reference[-1] in (stdlib / "LICENSE.txt").read_text()
    assert set(reference) <= set(sources.prose)
    held = data.prose_paragraphs("".join(data.held_out_code(stdlib).values()))
    assert held and not set(held) & set(sources.prose)                # held-out prose is never a training source


@pytest.mark.parametrize("form", data.TRAINING_FORMS)
def test_each_training_form_copies_what_it_reports_and_copy_mask_marks_it(form, sources, tokenizer):
    """Every reported copy occurs earlier and again later; :func:`data.copy_mask` (matches of up to 8
    tokens) marks nearly every token of the later occurrences past their first two."""
    marked = total = 0
    for seed in range(6):
        text, copied = data.training_document(random.Random(seed), form, sources, 2500, _render)
        assert copied, form
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = data.copy_mask(torch.tensor([enc.input_ids]), max_order=8)[0]
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
        text, copied = data.code_repeats_document(random.Random(seed), sources.code, 3000)
        assert set(text.split("\n")[:-1]) <= lines_of_code                 # nothing but real lines
        assert "# file: asyncio" not in text and copied


def test_planted_form_uses_training_words_only(sources):
    text, planted = data.planted_document(random.Random(5), sources.code, 3000)
    lines = text.split("\n")
    for line in planted:
        key, value = re.fullmatch(r'SECRET_([A-Z]+)_\d{4} = "([a-z]+-[a-z]+)-\d\d"', line).groups()
        assert key.lower() in data.TRAIN_WORDS and set(value.split("-")) <= set(data.TRAIN_WORDS)
        first, last = lines.index(line), len(lines) - 1 - lines[::-1].index(line)
        assert lines.count(line) == 2 and first < len(lines) // 2 + len(planted) <= last


def test_form_sample_has_the_length_and_refuses_what_it_cannot_render(sources, tokenizer):
    for form in data.TRAINING_FORMS:
        ids = data.form_sample(random.Random(0), tokenizer, form, sources, 300)
        assert len(ids) == 300 and ids == data.form_sample(random.Random(0), tokenizer, form, sources, 300)
    chat = tokenizer.decode(data.form_sample(random.Random(0), tokenizer, "chat", sources, 512))
    assert chat.startswith("<|im_start|>") and "<|im_start|>assistant" in chat
    bare = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    with pytest.raises(ValueError, match="chat template"):
        data.form_sample(random.Random(0), bare, "chat", sources, 300)
    with pytest.raises(ValueError, match="unknown training form 'poems'"):
        data.training_document(random.Random(0), "poems", sources, 300)
