"""The real drafter's training forms (SmolLM2-135M-Instruct's DFlash drafter), as text and as tokens.

Each form (:data:`TRAINING_FORMS`) is a document in which later text copies earlier text by content,
as users' prompts do: recurring code, restated prose, chat answers from a document, config values,
random ids, planted lines; and the natural forms (:data:`NATURAL_FORMS`), windows of held-in code, test
modules and documentation as they are, chosen for repeats far apart (nothing planted). Values drawn from a lexicon come from the training lexicons
(:data:`TRAIN_WORDS`, :data:`TRAIN_NAMES`); the evaluation's values (the planted-line cell's
``PLANT_WORDS``, the held-out forms' names, places and tracking numbers, :mod:`fold.demo.prompts`)
come from lexicons and formats that no training form uses (tests/demo/test_demo_forms.py checks both).
"""

from __future__ import annotations

import random
import re

from fold.demo.corpus import TrainingSources
from fold.demo.documents import random_hex
from fold.demo.tokens import encode

TRAIN_WORDS = (
    "apple", "badge", "bamboo", "barley", "basket", "beacon", "blossom", "bottle", "breeze", "bridge", "bucket",
    "button", "cabin", "cactus", "candle", "carpet", "castle", "chalk", "cherry", "cinnamon", "circle", "cloud",
    "clover", "coffee", "comet", "compass", "coral", "cotton", "crane", "cricket", "crystal", "daisy", "desert",
    "dolphin", "dragon", "drum", "eagle", "echo", "engine", "feather", "fern", "fiddle", "fig", "forest",
    "fountain", "garden", "ginger", "glove", "grape", "gravel", "hammer", "harp", "hazel", "helmet", "honey",
    "iris", "island", "ivory", "jacket", "jasmine", "kettle", "kite", "ladder", "lemon", "lily", "lotus",
    "magnet", "mango", "meteor", "mint", "mirror", "mountain", "needle", "nickel", "nutmeg", "oak", "ocean",
    "olive", "onion", "orange", "orchid", "otter", "paddle", "panda", "parrot", "peach", "pebble", "pencil",
    "pillow", "pine", "planet", "plum", "pocket", "pony", "puzzle", "quill", "rabbit", "rainbow", "reed",
    "ribbon", "rocket", "rose", "saddle", "sage", "salmon", "sandal", "shadow", "shell", "signal", "sparrow",
    "spider", "spoon", "star", "stone", "sugar", "summer", "sunset", "thunder", "thyme", "tiger", "timber",
    "tomato", "tower", "tulip", "turtle", "umbrella", "vanilla", "velvet", "violin", "wagon", "walnut",
    "walrus", "whistle", "window", "winter", "wizard", "yarn", "yellow", "zebra")
TRAIN_NAMES = ("Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Gustav", "Hana", "Ivan", "Jonas", "Kavya",
               "Liam", "Mei", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wanda",
               "Xavier", "Yara", "Zeno")
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TRAINING_FORMS = ("code", "prose", "chat", "config", "strings", "planted")     # documents (training_document)
NATURAL_FORMS = ("natural-code", "natural-tests", "natural-docs")                 # natural text (natural_sample)
CACHE_FORMS = TRAINING_FORMS + NATURAL_FORMS                                     # what a feature cache may hold
NATURAL_MIN_DISTANCE = 1024     # a natural form's window is chosen for its repeats at least this far back
NATURAL_SPAN = 8                # ... of at least this many tokens
NATURAL_CANDIDATES = 4          # windows drawn per sample, the one with the most far repeats kept


def _base62(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(BASE62) for _ in range(rng.randint(lo, hi)))


def train_value(rng: random.Random) -> str:
    """A value a training document stores and copies later, from the training lexicons only:
    hyphenated words, a name, a version, a hex or base62 string, a host or a path."""
    w = lambda: rng.choice(TRAIN_WORDS)  # noqa: E731
    kind = rng.randrange(8)
    if kind == 0:
        return f"{w()}-{w()}-{rng.randint(10, 99)}"
    if kind == 1:
        return f"{rng.choice(TRAIN_NAMES)} {w().capitalize()}"
    if kind == 2:
        return f"{rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 99)}"
    if kind == 3:
        return random_hex(rng, rng.randint(6, 16))
    if kind == 4:
        return _base62(rng, 16, 24)
    if kind == 5:
        return f"{w()}-{rng.randint(1, 9)}.{w()}.internal"
    if kind == 6:
        return f"/srv/{w()}/{w()}_{rng.randint(1, 99)}"
    return f"{w()}_{w()}_{rng.randint(100, 999)}"


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if len(s) >= 30]


def _fact(rng: random.Random) -> tuple[str, str, str]:
    """``(statement, question, value)`` of a stored fact, e.g. ``"The access code for the cabin
    archive is 4f0c2a9e."``, ``"What is the access code for the cabin archive?"``."""
    label = rng.choice(("access code", "build tag", "owner", "release", "storage path", "backup host",
                        "reference", "contact", "token", "version"))
    thing = f"the {rng.choice(TRAIN_WORDS)} {rng.choice(('archive', 'project', 'service', 'account', 'module'))}"
    value = train_value(rng)
    return f"The {label} for {thing} is {value}.", f"What is the {label} for {thing}?", value


def _take_paragraphs(rng: random.Random, prose: list[str], n_chars: int) -> list[str]:
    """Consecutive paragraphs of ``prose`` from a random start, about ``n_chars`` characters in all."""
    if not prose:
        raise ValueError("prose holds no paragraphs")
    i, out, size = rng.randrange(len(prose)), [], 0
    while size < n_chars:
        out.append(prose[i % len(prose)])
        size += len(out[-1]) + 2
        i += 1
    return out


def code_repeats_document(rng: random.Random, code: str, n_chars: int, candidates: int = 8) -> tuple[str, list[str]]:
    """About ``n_chars`` characters of held-in ``code`` where lines recur in the same file: the window,
    of ``candidates`` drawn, with the largest share of (non-trivial) lines seen earlier in it, and with
    probability 1/2 a block of 2-8 of its first-half lines repeated verbatim in its third quarter.
    Returns ``(text, copied)``: ``copied``, the strings that occur again later."""
    best, best_score = None, -1.0
    for _ in range(candidates):
        start = code.find("\n", rng.randrange(0, max(1, len(code) - n_chars))) + 1
        lines = code[start:start + n_chars].split("\n")[:-1]
        seen, again = set(), []
        for line in lines:
            key = line.strip()
            if len(key) >= 8:
                if key in seen:
                    again.append(line)
                seen.add(key)
        score = len(again) / max(1, len(lines))
        if score > best_score:
            best, best_score, copied = lines, score, again
    lines, copied = list(best), list(dict.fromkeys(copied))
    if rng.random() < 0.5 and len(lines) >= 16:
        size = rng.randint(2, 8)
        at = rng.randrange(0, len(lines) // 2 - size)
        block = lines[at:at + size]
        to = rng.randrange(len(lines) // 2, 3 * len(lines) // 4)
        lines[to:to] = block
        copied.append("\n".join(block))
    return "\n".join(lines) + "\n", copied


def prose_document(rng: random.Random, prose: list[str], n_chars: int) -> tuple[str, list[str]]:
    """Consecutive prose paragraphs (about ``n_chars`` characters) in which 2-4 stored facts
    (``"The owner for the cabin project is Hana Kettle."``) and 1-2 sentences of the early paragraphs
    are restated in later ones. Returns ``(text, copied)``."""
    paras = _take_paragraphs(rng, prose, n_chars)
    early = max(1, len(paras) // 2)
    copied = []
    for _ in range(rng.randint(2, 4)):
        statement, _, value = _fact(rng)
        i = rng.randrange(early)
        paras[i] = f"{paras[i]} {statement}"
        j = rng.randrange(i + 1, len(paras) + 1)
        paras.insert(j, f"{rng.choice(('As noted above,', 'Recall that', 'Again,', 'To repeat:'))} the {statement[4:]}")
        copied.append(statement[4:-1])                       # after "The ", before the full stop
    sentences = [s for p in paras[:early] for s in _sentences(p)]
    for s in rng.sample(sentences, min(len(sentences), rng.randint(1, 2))):
        j = rng.randrange(early, len(paras) + 1)
        paras.insert(j, s)
        copied.append(s)
    return "\n\n".join(paras) + "\n", copied


def chat_messages(rng: random.Random, prose: list[str], n_chars: int) -> tuple[list[dict], list[str]]:
    """A chat (``[{"role", "content"}]``, for the target's chat template) about a document of prose
    paragraphs holding 3-5 stored facts: the user gives the document and asks for one fact, the
    assistant answers from the text, and further questions follow until about ``n_chars`` characters.
    Returns ``(messages, copied)``: each answer's value occurs in the document."""
    paras = _take_paragraphs(rng, prose, int(0.45 * n_chars))
    facts = [_fact(rng) for _ in range(rng.randint(3, 5))]
    for statement, _, _ in facts:
        i = rng.randrange(len(paras))
        paras[i] = f"{paras[i]} {statement}"
    document = "\n\n".join(paras)
    messages = []
    if rng.random() < 0.5:
        messages.append(dict(role="system", content="Answer the user's questions from the document they give."))
    size, first, copied = len(document), True, []
    while first or size < n_chars:
        statement, question, value = rng.choice(facts)
        ask = (f"{rng.choice(('Here is a document.', 'Read this text:', 'Document:'))}\n\n{document}\n\n{question}"
               if first else question)
        answer = rng.choice((statement, value, f"It is {value}.", f"According to the document, {statement[0].lower()}"
                             f"{statement[1:]}"))
        messages += [dict(role="user", content=ask), dict(role="assistant", content=answer)]
        size += len(question) + len(answer) + 40
        first = False
        copied.append(value)
    return messages, copied


def _config_file(rng: random.Random, syntax: str, records: list[tuple[str, dict[str, str]]]) -> str:
    """``records`` ([(name, {field: value})]) written in one config syntax."""
    if syntax == "json":
        import json

        return json.dumps({name: fields for name, fields in records}, indent=2) + "\n"
    if syntax == "yaml":
        return "".join(f"{name}:\n" + "".join(f"  {k}: {v}\n" for k, v in fields.items()) for name, fields in records)
    if syntax == "ini":
        return "\n".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()) for name, fields in records)
    if syntax == "toml":
        return "\n".join(f"[{name}]\n" + "".join(f'{k} = "{v}"\n' for k, v in fields.items())
                         for name, fields in records)
    if syntax == "env":
        return "".join(f"{name.upper()}_{k.upper()}={v}\n" for name, fields in records for k, v in fields.items())
    if syntax == "csv":
        keys = list(dict.fromkeys(k for _, fields in records for k in fields))
        return ",".join(["name"] + keys) + "\n" + "".join(
            ",".join([name] + [fields.get(k, "") for k in keys]) + "\n" for name, fields in records)
    raise ValueError(f"unknown config syntax {syntax!r}")


CONFIG_SYNTAXES = ("json", "yaml", "ini", "toml", "env", "csv")
CONFIG_FIELDS = ("host", "port", "user", "token", "path", "version", "owner", "bucket", "key_id")


def config_document(rng: random.Random, n_chars: int) -> tuple[str, list[str]]:
    """Config files (JSON, YAML, INI, TOML, .env, CSV) of named records whose later records, in the same
    file or in another syntax, reuse a value stored earlier in the same field (a replica's host, a
    shared token). About
    ``n_chars`` characters. Returns ``(text, copied)``."""
    stored: dict[str, list[str]] = {}                     # field -> values stored so far
    parts, copied, size = [], [], 0
    while size < n_chars:
        syntax = rng.choice(CONFIG_SYNTAXES)
        records = []
        for _ in range(rng.randint(3, 10)):
            fields = {}
            for key in rng.sample(CONFIG_FIELDS, rng.randint(2, 5)):
                if stored.get(key) and rng.random() < 0.4:
                    value = rng.choice(stored[key][-20:])
                    copied.append(value)
                else:
                    value = str(rng.randint(1024, 65535)) if key == "port" else train_value(rng)
                    stored.setdefault(key, []).append(value)
                fields[key] = value
            records.append((f"{rng.choice(TRAIN_WORDS)}_{rng.choice(TRAIN_WORDS)}", fields))
        part = f"# file: config/{rng.choice(TRAIN_WORDS)}.{syntax}\n" + _config_file(rng, syntax, records) + "\n"
        parts.append(part)
        size += len(part)
    return "".join(parts), list(dict.fromkeys(copied))


def random_id(rng: random.Random) -> str:
    """A random identifier in one of the training formats: a UUID, a lowercase hex digest prefix, a
    base62 token of 16-32 characters, a 0x-prefixed hex number or a decimal id of 6-12 digits."""
    kind = rng.randrange(5)
    if kind == 0:
        h = random_hex(rng, 32)
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    if kind == 1:
        return random_hex(rng, rng.choice((7, 12, 16, 40)))
    if kind == 2:
        return _base62(rng, 16, 32)
    if kind == 3:
        return "0x" + random_hex(rng, rng.choice((8, 16)))
    return str(rng.randint(10 ** 5, 10 ** 12 - 1))


def strings_document(rng: random.Random, n_chars: int, repeat_p: float = 0.35) -> tuple[str, list[str]]:
    """Lines of random identifiers (:func:`random_id`) in record-like contexts; with probability
    ``repeat_p`` a line names an identifier of any earlier line (uniformly, so often far back), and
    sometimes repeats the whole line. About ``n_chars`` characters. Returns ``(text, copied)``."""
    lines: list[str] = []
    ids: list[str] = []
    copied = []
    size = 0
    while size < n_chars:
        if lines and rng.random() < repeat_p:
            if rng.random() < 0.3:
                line = rng.choice(lines)
                copied.append(line.strip())
            else:
                value = rng.choice(ids)
                copied.append(value)
                line = f"{rng.choice(TRAIN_WORDS)}_ref={value}\n"
        else:
            value = random_id(rng)
            ids.append(value)
            line = rng.choice((f"{rng.choice(TRAIN_WORDS)}_id={value}\n", f'"{value}",\n',
                               f"{value}  {rng.choice(TRAIN_WORDS)}/{rng.choice(TRAIN_WORDS)}\n",
                               f"{rng.choice(TRAIN_WORDS)}: {value}\n"))
        lines.append(line)
        size += len(line)
    return "".join(lines), list(dict.fromkeys(copied))


def planted_document(rng: random.Random, code: str, n_chars: int) -> tuple[str, list[str]]:
    """About ``n_chars`` characters of held-in code with 2-4 planted ``SECRET_<WORD>_<NNNN> =
    "<word>-<word>-<NN>"`` lines in its first half, each repeated once later at a line break (the
    format of ``fold-demo --real``'s ``retrieval`` cell, with words of :data:`TRAIN_WORDS`, never
    :data:`PLANT_WORDS`). Returns ``(text, copied)``."""
    w = lambda: rng.choice(TRAIN_WORDS)  # noqa: E731
    start = code.find("\n", rng.randrange(0, max(1, len(code) - n_chars))) + 1
    lines = code[start:start + n_chars].split("\n")[:-1]
    planted = [f'SECRET_{w().upper()}_{rng.randint(1000, 9999)} = "{w()}-{w()}-{rng.randint(10, 99)}"'
               for _ in range(rng.randint(2, 4))]
    half = max(2, len(lines) // 2)
    for line in planted:
        lines.insert(rng.randrange(0, half), line)
    for line in planted:
        lines.insert(rng.randrange(half + len(planted), len(lines) + 1), line)
    return "\n".join(lines) + "\n", planted


def training_document(rng: random.Random, form: str, sources: TrainingSources, n_chars: int,
                      render_chat=None) -> tuple[str, list[str]]:
    """About ``n_chars`` characters of one training form (:data:`TRAINING_FORMS`) -> ``(text, copied)``,
    ``copied`` the strings that occur earlier in ``text`` and again later. ``render_chat``: messages
    -> text (the target's chat template), needed by ``"chat"``."""
    if form == "code":
        return code_repeats_document(rng, sources.code, n_chars)
    if form == "prose":
        return prose_document(rng, sources.prose, n_chars)
    if form == "chat":
        if render_chat is None:
            raise ValueError("form 'chat' needs render_chat (the tokenizer's chat template)")
        messages, copied = chat_messages(rng, sources.prose, n_chars)
        return render_chat(messages), copied
    if form == "config":
        return config_document(rng, n_chars)
    if form == "strings":
        return strings_document(rng, n_chars)
    if form == "planted":
        return planted_document(rng, sources.code, n_chars)
    raise ValueError(f"unknown training form {form!r}; expected one of {TRAINING_FORMS}")


def natural_text(form: str, sources: TrainingSources) -> str:
    """The text a natural form (:data:`NATURAL_FORMS`) is cut from: held-in code, tests or documentation."""
    text = {"natural-code": sources.code, "natural-tests": sources.tests, "natural-docs": sources.docs}[form]
    if not text:
        raise ValueError(f"form {form!r}: its source text is empty (the standard library lacks it here)")
    return text


def natural_sample(rng: random.Random, tokenizer, text: str, length: int, min_distance: int = NATURAL_MIN_DISTANCE,
                   span: int = NATURAL_SPAN, candidates: int = NATURAL_CANDIDATES) -> list[int]:
    """``length`` consecutive tokens of ``text`` from a line start, nothing changed: of ``candidates`` windows
    drawn, the one in which most spans of ``span`` tokens repeat one at least ``min(min_distance, length // 2)``
    tokens back (:func:`fold.demo.natural.repeat_starts`), so the natural text's own repeats are far apart."""
    from fold.demo.natural import repeat_starts

    distance = min(min_distance, length // 2)
    best, best_score = None, -1
    for _ in range(candidates):
        n_chars = 5 * length
        while True:
            start = text.find("\n", rng.randrange(0, max(1, len(text) - n_chars))) + 1
            ids = encode(tokenizer, text[start:start + n_chars])
            if len(ids) >= length or n_chars >= len(text):
                break
            n_chars *= 2
        if len(ids) < length:
            raise ValueError(f"the text holds fewer than {length} tokens")
        ids = ids[:length]
        score = sum(c - s >= distance for c, s in repeat_starts(ids, span))
        if score > best_score:
            best, best_score = ids, score
    return best


def form_sample(rng: random.Random, tokenizer, form: str, sources: TrainingSources, length: int) -> list[int]:
    """The first ``length`` tokens of a document of one training form (``"chat"`` rendered with the
    tokenizer's chat template; a natural form, :func:`natural_sample` of its text)."""
    if form in NATURAL_FORMS:
        return natural_sample(rng, tokenizer, natural_text(form, sources), length)
    render = None
    if form == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("form 'chat' needs a tokenizer with a chat template")
        render = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)  # noqa: E731
    n_chars = 4 * length
    while True:
        ids = encode(tokenizer, training_document(rng, form, sources, n_chars, render)[0])
        if len(ids) >= length:
            return ids[:length]
        n_chars = int(n_chars * 1.25) + 1

