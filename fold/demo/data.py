"""Text for the demo: Python's own standard library sources and generated copy documents, as BPE tokens.

- Code: ``.py`` files of the standard library found on this machine, split **by package**:
  :data:`HELD_OUT` packages are never trained on (neither the tokenizer nor the models); the demo
  concatenates them repository-style (``# file: <path>`` headers) to any length.
- Key-value documents: ``key_NN: v1 v2`` lines (two random 8-hex words); later lines repeat an
  earlier entry, so predicting the value of a repeated key needs retrieval by content.
- Repeated-line documents: lines of code, some repeated verbatim later.
- Random-string documents: lines of random identifiers and hex strings, some repeated far later.

The generated documents are where copying is the only way to predict: a random value can only be
known by finding where it was stored. :func:`copy_mask` marks those positions in a token sequence.

The real pair (SmolLM2-135M-Instruct) has forms of its own: :data:`TRAINING_FORMS`, the documents its
drafter is trained on (each copies by content: recurring code, restated prose, chat answers from a
document, config values, random ids, planted lines; values from :data:`TRAIN_WORDS` and
:data:`TRAIN_NAMES`), and :data:`HELD_OUT_FORMS`, retrieval prompts of forms and lexicons that no
training form contains, for ``fold-demo --real``.

The tokenizer (:func:`train_tokenizer`) is a byte-level BPE trained with Hugging Face ``tokenizers``
on the training split; its pre-tokenizer keeps identifiers and hex words whole (``[A-Za-z0-9_]+``
with an optional leading space), so one token stands for a word piece, not a byte.
"""

from __future__ import annotations

import ast
import datetime
import random
import re
import sysconfig
from collections import Counter
from pathlib import Path
from typing import NamedTuple

HELD_OUT = ("asyncio", "email", "json", "xml")
SKIP = {"site-packages", "test", "tests", "encodings", "pydoc_data", "__pycache__", "lib2to3", "turtledemo",
        "ensurepip", "idle_test"}
HEX = "0123456789abcdef"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|endoftext|>"
PRE_TOKENIZER_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]+|\s+(?!\S)|\s+"""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def package_files(root: Path | None = None) -> dict[str, list[Path]]:
    """Top-level package or module name -> its ``.py`` files (sorted), skipping tests and data tables."""
    root = root or stdlib_dir()
    out: dict[str, list[Path]] = {}
    for entry in sorted(root.iterdir()):
        if entry.name in SKIP or entry.name.startswith(("config-", ".")):
            continue
        if entry.is_dir():
            files = sorted(f for f in entry.rglob("*.py") if not SKIP.intersection(f.relative_to(root).parts))
            if files:
                out[entry.name] = files
        elif entry.suffix == ".py":
            out[entry.stem] = [entry]
    return out


def read_files(files: list[Path], root: Path | None = None) -> str:
    """Repository-style concatenation: a ``# file: <path>`` header before each file."""
    root = root or stdlib_dir()
    parts = []
    for f in files:
        try:
            parts.append(f"# file: {f.relative_to(root)}\n" + f.read_text(encoding="utf-8", errors="replace") + "\n")
        except OSError:
            continue
    return "".join(parts)


def _held_out(packages: dict[str, list[Path]], root: Path | None, held_out) -> dict[str, str]:
    missing = [p for p in held_out if p not in packages]
    if missing:
        raise ValueError(f"held-out packages {missing} not found under {root or stdlib_dir()}")
    return {name: read_files(packages[name], root) for name in held_out}


def held_out_code(root: Path | None = None, held_out=HELD_OUT) -> dict[str, str]:
    """{held-out package: its code}, without reading the training packages."""
    return _held_out(package_files(root), root, held_out)


def split_corpus(root: Path | None = None, held_out=HELD_OUT) -> tuple[str, dict[str, str]]:
    """(training code, {held-out package: its code}); raises if a held-out package is missing."""
    packages = package_files(root)
    held = _held_out(packages, root, held_out)
    return read_files([f for name, fs in packages.items() if name not in held_out for f in fs], root), held


# -- generated documents (text) ----------------------------------------------------------------------

def _word(rng: random.Random, lo: int = 4, hi: int = 9) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _hex(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice(HEX) for _ in range(n))


def _value(rng: random.Random) -> str:
    return f"{_hex(rng)} {_hex(rng)}"


def kv_document(rng: random.Random, n_chars: int, reach: int = 60, repeat_p: float = 0.35) -> str:
    """``key_NN: v1 v2`` lines (two 8-hex words); with probability ``repeat_p`` a line repeats one of
    the last ``reach`` entries verbatim. About ``n_chars`` characters."""
    entries: list[str] = []
    lines: list[str] = []
    size = 0
    while size < n_chars:
        if entries and rng.random() < repeat_p:
            line = rng.choice(entries[-reach:])
        else:
            line = f"{_word(rng)}_{rng.randint(0, 99)}: {_value(rng)}\n"
            entries.append(line)
        lines.append(line)
        size += len(line)
    return "".join(lines)


def repeated_lines_document(rng: random.Random, code: str, n_chars: int, reach: int = 40) -> str:
    """Lines drawn from ``code``; about a third of them repeat one of the last ``reach`` lines verbatim."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        if len(out) > 2 and rng.random() < 0.35:
            line = rng.choice(out[-reach:])
        else:
            start = rng.randrange(0, max(1, len(code) - 200))
            nl = code.find("\n", start)
            end = code.find("\n", nl + 1)
            line = code[nl + 1:end + 1] if nl >= 0 and end > nl else "pass\n"
        out.append(line)
        size += len(line)
    return "".join(out)


def random_strings_document(rng: random.Random, n_chars: int, repeat_p: float = 0.4) -> str:
    """Lines of random identifiers and hex strings; with probability ``repeat_p`` a line repeats any
    earlier line (uniformly, so often far back)."""
    lines: list[str] = []
    size = 0
    while size < n_chars:
        if len(lines) > 1 and rng.random() < repeat_p:
            line = rng.choice(lines)
        else:
            words = [(_hex(rng, rng.randint(4, 12)) if rng.random() < 0.4 else _word(rng, 3, 10))
                     for _ in range(rng.randint(2, 6))]
            line = rng.choice(["", "    ", "        "]) + rng.choice([" ", "_", ".", ", ", " = "]).join(words) + "\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


DOCUMENT_KINDS = ("code", "kv", "lines", "strings")


def training_text(rng: random.Random, code: str, n_chars: int, kind: str) -> str:
    """About ``n_chars`` characters of one kind of training document (see :data:`DOCUMENT_KINDS`)."""
    if kind == "code":
        start = rng.randrange(0, max(1, len(code) - n_chars))
        return code[start:start + n_chars]
    if kind == "kv":
        return kv_document(rng, n_chars, reach=rng.choice([8, 20, 60, 200]))
    if kind == "lines":
        return repeated_lines_document(rng, code, n_chars, reach=rng.choice([10, 40, 120]))
    if kind == "strings":
        return random_strings_document(rng, n_chars)
    raise ValueError(f"unknown document kind {kind!r}; expected one of {DOCUMENT_KINDS}")


# -- the tokenizer --------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) with ``vocab_size`` entries, the last two
    special: ``<|endoftext|>`` and ``<|mask|>`` (the drafter's MASK)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([EOS_TOKEN, MASK_TOKEN])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` reads."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token=EOS_TOKEN, mask_token=MASK_TOKEN,
        model_max_length=1 << 20, clean_up_tokenization_spaces=False), indent=1))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added) with a ``tokenizers.Tokenizer`` or a transformers tokenizer."""
    if hasattr(tokenizer, "encode_batch"):                   # tokenizers.Tokenizer
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False).input_ids


def _fast(tokenizer):
    """The underlying ``tokenizers.Tokenizer`` (offsets, batch encoding)."""
    return tokenizer if hasattr(tokenizer, "encode_batch") else tokenizer.backend_tokenizer


# -- token sequences ------------------------------------------------------------------------------------

def training_sample(rng: random.Random, tokenizer, code: str, length: int, mix) -> list[int]:
    """``length`` tokens of one training document; ``mix``: shares of :data:`DOCUMENT_KINDS`."""
    kind = rng.choices(DOCUMENT_KINDS, weights=mix)[0]
    n_chars = 4 * length + 64
    while True:
        ids = encode(tokenizer, training_text(rng, code, n_chars, kind))
        if len(ids) > length or (kind == "code" and n_chars >= len(code)):
            break
        n_chars *= 2
    start = rng.randrange(0, len(ids) - length + 1) if kind == "code" else 0
    out = ids[start:start + length]
    if len(out) < length:
        raise ValueError(f"the code corpus holds only {len(ids)} tokens, fewer than --seq-len {length}")
    return out


def copy_mask(ids, order: int = 2, max_order: int | None = None):
    """``mask[p]`` is True where token ``p`` follows an earlier occurrence of the ``order`` tokens
    before it and equals the token that followed there: a position an induction copy predicts.
    With ``max_order`` (> ``order``), the earlier occurrence that predicts is the one whose match with
    the tokens before ``p`` is longest (up to ``max_order`` tokens; the latest of equally long ones),
    as a copy of a long span with common pairs of tokens inside it (digits, ``" of the"``) needs;
    by default the latest occurrence of the ``order`` tokens. ``ids`` [B, T] (tensor) -> bool [B, T]."""
    import torch

    max_order = order if max_order is None else max_order
    if max_order < order:
        raise ValueError(f"max_order must be >= order={order}, got {max_order}")
    out = torch.zeros(ids.shape, dtype=torch.bool)
    rows = ids.tolist()
    for b, row in enumerate(rows):
        seen: dict[tuple, list[int]] = {}                    # n-gram -> the positions that followed it
        for p in range(order, len(row)):
            key = tuple(row[p - order:p])
            after = seen.setdefault(key, [])
            if after:
                best, best_len = after[-1], -1
                for j in reversed(after):                    # latest first: a tie keeps the latest
                    k = order
                    while k < max_order and j - k - 1 >= 0 and row[j - k - 1] == row[p - k - 1]:
                        k += 1
                    if k > best_len:
                        best, best_len = j, k
                        if k == max_order:
                            break
                out[b, p] = row[best] == row[p]
            after.append(p)
    return out


def retrieval_prompt(rng: random.Random, tokenizer, length: int, min_distance: int) -> tuple[list[int], list[int]]:
    """A key-value document of ``length`` tokens with no repeated key, ending with ``"<key>:"`` for a
    key stored at least ``min_distance`` tokens before the end -> ``(prompt ids, answer ids)``: the
    answer is the stored value's tokens (``" v1 v2"``, without the line break).

    Lines start with a letter and end with a line break, which the pre-tokenizer splits on, so the
    document's tokens are the concatenation of its lines' tokens."""
    lines: list[list[int]] = []
    total = 0
    while total < length:
        batch = [f"{_word(rng)}_{rng.randint(0, 99)}: {_value(rng)}\n" for _ in range(64)]
        for text, enc in zip(batch, _fast(tokenizer).encode_batch(batch, add_special_tokens=False)):
            lines.append((text, enc.ids))
            total += len(enc.ids)
    # the last lines, up to ``length`` tokens including the query
    kept, size = [], 0
    for text, ids in reversed(lines):
        if size + len(ids) + 8 > length:
            break
        kept.append((text, ids))
        size += len(ids)
    kept.reverse()
    keys = [text.split(":")[0] for text, _ in kept]
    uses = Counter(keys)
    far, before = [], size
    for i, (text, ids) in enumerate(kept):
        if before >= min_distance and uses[keys[i]] == 1:
            far.append(i)
        before -= len(ids)
    if not far:
        raise ValueError(f"length {length} is too short for a key {min_distance} tokens back")
    i = rng.choice(far)
    query = encode(tokenizer, f"{keys[i]}:")
    prompt = [t for _, ids in kept for t in ids] + query
    answer = kept[i][1][len(query):-1]                       # after "key:", before the line break
    return prompt, answer


def code_prompt(held_out: dict[str, list[int]], rng: random.Random, length: int, newline_ids=()) -> list[int]:
    """``length`` tokens of a held-out package (token ids), starting after a line break when one is near."""
    name = rng.choice(sorted(held_out))
    ids = held_out[name]
    if len(ids) < length + 1:
        ids = [t for n in sorted(held_out) for t in held_out[n]]
    start = rng.randrange(0, len(ids) - length)
    newline_ids = set(newline_ids)
    for s in range(start, min(start + 64, len(ids) - length)):
        if ids[s] in newline_ids:
            start = s + 1
            break
    return ids[start:start + length]


PLANT_WORDS = ("violet", "harbor", "amber", "falcon", "cedar", "orbit", "maple", "copper", "silver", "meadow",
               "lantern", "river", "granite", "willow", "ember", "canyon", "thistle", "cobalt", "juniper", "quartz",
               "saffron", "glacier", "heron", "marble", "nectar", "obsidian", "pepper", "raven", "sable", "tundra")


def retrieved(generated: list[int], answer: list[int]) -> bool:
    """Whether a target retrieved a stored value: its output (``generated``, token ids after the
    prompt) begins with the value's ids (``answer``, as the retrieval prompts return it)."""
    return list(generated[:len(answer)]) == list(answer)


def planted_retrieval_prompt(rng: random.Random, tokenizer, code: dict[str, str], length: int,
                             min_distance: int) -> tuple[list[int], list[int]]:
    """Code with one planted line ``KEY_WORD_1234 = "word-word-12"`` at least ``min_distance`` tokens
    before the end, the prompt ending with ``KEY_WORD_1234 = "`` -> ``(prompt ids, answer ids)``; the
    answer is the value and its closing quote. ``code``: {package: source text} (the held-out packages).

    The toy target's key-value documents (:func:`retrieval_prompt`) hold hundreds of look-alike keys;
    a small pretrained model retrieves a line planted in ordinary code instead."""
    name = rng.choice(sorted(code))
    text = code[name]
    if len(text) < 6 * length:
        text = "".join(code[n] for n in sorted(code))
    key = f"SECRET_{rng.choice(PLANT_WORDS).upper()}_{rng.randint(1000, 9999)}"
    value = f"{rng.choice(PLANT_WORDS)}-{rng.choice(PLANT_WORDS)}-{rng.randint(10, 99)}"
    query = f'\n{key} = "'
    start = text.find("\n", rng.randrange(0, max(1, len(text) - 8 * length))) + 1
    window = text[start:start + 4 * length]
    while len(encode(tokenizer, window)) < length and start + len(window) < len(text):
        window = text[start:start + 2 * len(window)]
    window = window[:window.rfind("\n")]
    ids = encode(tokenizer, window)
    if len(ids) < length:
        raise ValueError(f"the code holds fewer than {length} tokens")
    window = tokenizer.decode(ids[len(ids) - length:]) if hasattr(tokenizer, "decode") else window
    window = window[window.find("\n") + 1:]                      # start at a line
    # the planted line goes at a line break in the first third of the window (by characters)
    cut = window.find("\n", rng.randrange(len(window) // 20, len(window) // 3)) + 1
    full = window[:cut] + f'{key} = "{value}"\n' + window[cut:] + query
    return _question_at_end(tokenizer, full, cut, f'{value}"', length, min_distance, "planted line")


# -- the real drafter's training forms (text) -------------------------------------------------------------
#
# Each form is a document in which later text copies earlier text by content, as users' prompts do.
# Values drawn from a lexicon come from the training lexicons below; the evaluation's values (the
# planted-line cell's PLANT_WORDS, the held-out forms' names, places and tracking numbers) come from
# lexicons and formats that no training form uses (tests/demo/test_demo_forms.py checks both).

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
TRAINING_FORMS = ("code", "prose", "chat", "config", "strings", "planted")


class TrainingSources(NamedTuple):
    """What the training forms are cut from: ``code``, held-in standard-library code (repository-style
    text, :func:`read_files`); ``prose``, paragraphs of held-in prose (:func:`prose_paragraphs` of that
    code, the language reference topics of ``pydoc_data`` and the Python license)."""
    code: str
    prose: list[str]


def _paragraphs(text: str, min_chars: int = 40) -> list[str]:
    """Blank-line separated paragraphs of ``text``, each joined onto one line, that read as prose:
    at least ``min_chars`` characters, mostly letters and spaces, no doctest or code markers."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(line.strip() for line in block.strip().splitlines())
        if len(para) < min_chars or para.startswith((">>>", "...", "$")) or "::" in para:
            continue
        if sum(c.isalpha() or c == " " for c in para) >= 0.85 * len(para):
            out.append(para)
    return out


def prose_paragraphs(code: str) -> list[str]:
    """Prose paragraphs of repository-style code (``# file:`` headers, :func:`read_files`): its
    docstrings (module, class, function) and its comment blocks of two or more lines, file by file."""
    out = []
    for source in re.split(r"^# file: .*\n", code, flags=re.M):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        out += _paragraphs(doc)
        block: list[str] = []
        for line in source.splitlines() + [""]:
            stripped = line.strip()
            if stripped.startswith("# ") and not stripped.startswith("# file:"):
                block.append(stripped[2:])
                continue
            if len(block) >= 2:
                out += _paragraphs("\n".join(block))
            block = []
    return out


def reference_prose(root: Path | None = None) -> list[str]:
    """Paragraphs of the language reference topics (``pydoc_data/topics.py``) and ``LICENSE.txt`` of
    the standard library at ``root``; either may be absent."""
    root = root or stdlib_dir()
    out = []
    topics = root / "pydoc_data" / "topics.py"
    if topics.is_file():
        tree = ast.parse(topics.read_text(encoding="utf-8", errors="replace"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for text in ast.literal_eval(node.value).values():
                    out += _paragraphs(text)
    license_file = root / "LICENSE.txt"
    if license_file.is_file():
        out += _paragraphs(license_file.read_text(encoding="utf-8", errors="replace"))
    return out


def training_sources(root: Path | None = None, held_out=HELD_OUT) -> TrainingSources:
    """The held-in code and prose of the standard library at ``root`` (the held-out packages are
    never read into either)."""
    code, _ = split_corpus(root, held_out)
    return TrainingSources(code, prose_paragraphs(code) + reference_prose(root))


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
        return _hex(rng, rng.randint(6, 16))
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
        h = _hex(rng, 32)
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    if kind == 1:
        return _hex(rng, rng.choice((7, 12, 16, 40)))
    if kind == 2:
        return _base62(rng, 16, 32)
    if kind == 3:
        return "0x" + _hex(rng, rng.choice((8, 16)))
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


def form_sample(rng: random.Random, tokenizer, form: str, sources: TrainingSources, length: int) -> list[int]:
    """The first ``length`` tokens of a document of one training form (``"chat"`` rendered with the
    tokenizer's chat template)."""
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


# -- held-out retrieval forms (evaluation only) ---------------------------------------------------------------
#
# Forms of prompt that no training form contains, with lexicons of their own: a support e-mail thread
# asking at the end for a parcel's tracking number given early, and a series of meeting minutes
# recalling at the end the venue agreed in an early meeting. Their filler is prose of the held-out
# packages (:func:`prose_paragraphs` of :func:`held_out_code`).

HELD_OUT_FIRST_NAMES = ("Maren", "Tobias", "Ingrid", "Rafael", "Yusuf", "Odile", "Keziah", "Lorcan", "Anouk",
                        "Teodor", "Saoirse", "Emeric", "Ilse", "Dario", "Wrenna", "Caspian")
HELD_OUT_LAST_NAMES = ("Oakley", "Varga", "Lindqvist", "Okafor", "Brennan", "Castellano", "Whitcombe", "Hargreave",
                       "Delacroix", "Nakamura", "Szabo", "Achterberg")
TRACKING_PREFIXES = ("RR", "CP", "EE", "LX", "RA", "CX")
TRACKING_COUNTRIES = ("DE", "GB", "FR", "NL", "SE", "PL", "IE")
TRACKING_PATTERN = r"\b[A-Z]{2}\d{9}[A-Z]{2}\b"          # a tracking number (UPU S10); no training form makes one
VENUE_PLACES = ("Ashcombe", "Brantwood", "Fellhaven", "Gorsedale", "Kilbarron", "Marlowmere", "Pendrick",
                "Quarrendon", "Rosslyn", "Tavistoke", "Wendover", "Ystrad")
VENUE_KINDS = ("Hall", "House", "Pavilion", "Centre", "Lodge")
VENUE_STREETS = ("Larkspur", "Hollybrook", "Foxglove", "Kingfisher", "Bramblewick", "Ferncliffe", "Pennywort",
                 "Sorrel", "Yarrow")
VENUE_WAYS = ("Road", "Lane", "Terrace", "Crescent")
HELD_OUT_LEXICON = (PLANT_WORDS + HELD_OUT_FIRST_NAMES + HELD_OUT_LAST_NAMES + TRACKING_PREFIXES + TRACKING_COUNTRIES
                    + VENUE_PLACES + VENUE_KINDS + VENUE_STREETS + VENUE_WAYS)
HELD_OUT_CUES = ("tracking number", "will be held at", "Subject: Re:", "## Decisions", "Present:")


def _question_at_end(tokenizer, text: str, stored_at: int, value: str, length: int, min_distance: int,
                     what: str) -> tuple[list[int], list[int]]:
    """``(prompt, answer)``: the last ``length`` tokens of ``text`` (which ends with the question's cue)
    and the tokens of ``value`` after it; ``stored_at``, the character offset in ``text`` where the
    stored copy begins, must be at least ``min_distance`` tokens before the end and inside the prompt."""
    ids = encode(tokenizer, text)
    back = len(ids) - len(encode(tokenizer, text[:stored_at]))
    prompt = ids[max(0, len(ids) - length):]
    if back > len(prompt) or back < min_distance:
        raise ValueError(f"the {what} is {back} tokens back in a {len(prompt)}-token prompt; "
                         f"wanted at least {min_distance}")
    full = encode(tokenizer, text + value)
    if full[:len(ids)] != ids:
        raise ValueError(f"the {what}'s value {value!r} does not tokenize apart from the cue before it")
    return prompt, full[len(ids):]


def _unit_document(rng: random.Random, tokenizer, unit, statement: str, final, length: int,
                   min_distance: int) -> tuple[str, int]:
    """Units of a document (``unit(rng) -> (head, tail, can_store)``) until ``length`` tokens, then
    ``final()`` (the last unit, ending with the question's cue), the ``statement`` placed between the
    head and tail of a unit that can store it, at least ``min_distance`` tokens (and at most
    ``length`` less a margin) before the end. Returns ``(text, offset of the statement)``."""
    n = lambda t: len(encode(tokenizer, t))  # noqa: E731
    units, sizes, total = [], [], n(statement)
    while total < length + 64:
        head, tail, can_store = unit(rng)
        units.append((head, tail, can_store))
        sizes.append((n(head), n(tail)))
        total += sum(sizes[-1])
    final = final()
    after = n(final)                                      # tokens from a unit's slot to the end
    slots = []
    for i in range(len(units) - 1, -1, -1):
        back = after + sizes[i][1] + n(statement)
        if units[i][2] and min_distance + 32 <= back <= length - 32:
            slots.append(i)
        after += sum(sizes[i])
    if not slots:
        raise ValueError(f"length {length} is too short to store a value {min_distance} tokens back")
    i = rng.choice(slots)
    before = "".join(h + t for h, t, _ in units[:i]) + units[i][0]
    text = before + statement + units[i][1] + "".join(h + t for h, t, _ in units[i + 1:]) + final
    return text, len(before)


def _held_out_names(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` distinct (first, last) names of the held-out lexicon, no two sharing a first or last name."""
    return list(zip(rng.sample(HELD_OUT_FIRST_NAMES, n), rng.sample(HELD_OUT_LAST_NAMES, n)))


def _dates(rng: random.Random, step_days: tuple[int, int]):
    """A calendar from a random day of 2026 on, each call ``step_days`` (low, high) days after the last."""
    day = datetime.date(2026, 1, 1) + datetime.timedelta(days=rng.randrange(365))

    def next_day() -> datetime.date:
        nonlocal day
        day += datetime.timedelta(days=rng.randint(*step_days))
        return day
    return next_day


def _filler(rng: random.Random, prose: list[str], max_chars: int = 600) -> str:
    short = [p for p in prose if len(p) <= max_chars]
    if not short:
        raise ValueError(f"prose holds no paragraph of at most {max_chars} characters")
    return rng.choice(short)


def email_retrieval_prompt(rng: random.Random, tokenizer, prose: list[str], length: int,
                           min_distance: int) -> tuple[list[int], list[int]]:
    """A support e-mail thread (``From:``/``To:``/``Date:``/``Subject:`` headers, bodies of held-out
    ``prose`` paragraphs) in which an agent's message, at least ``min_distance`` tokens before the end,
    gives a parcel's tracking number (``RR482913775DE``); the last message ends with ``"... the tracking
    number is"`` -> ``(prompt ids, answer ids)``, ``length`` prompt tokens; the answer is the number
    (with its leading space)."""
    customer, agent = _held_out_names(rng, 2)
    case = rng.randint(10000, 99999)
    value = f"{rng.choice(TRACKING_PREFIXES)}{rng.randint(10 ** 8, 10 ** 9 - 1)}{rng.choice(TRACKING_COUNTRIES)}"
    next_day = _dates(rng, (0, 1))

    def message(sender, recipient, body: list[str]) -> str:
        return (f"From: {sender[0]} {sender[1]} <{sender[0].lower()}.{sender[1].lower()}@kestrelworks.example>\n"
                f"To: {recipient[0].lower()}.{recipient[1].lower()}@kestrelworks.example\n"
                f"Date: {next_day():%a, %d %b %Y} {rng.randint(8, 18):02d}:{rng.randint(0, 59):02d}\nSubject: Re: Replacement controller board, case KW-{case}\n\n"
                f"Hi {recipient[0]},\n\n" + "".join(p + "\n\n" for p in body))

    turns = [0]                                           # the thread alternates: customer, agent, customer, ...

    def unit(rng):
        by_agent, turns[0] = turns[0] % 2 == 1, turns[0] + 1
        sender, recipient = (agent, customer) if by_agent else (customer, agent)
        head = message(sender, recipient, [_filler(rng, prose)])
        tail = (_filler(rng, prose) + "\n\n" if rng.random() < 0.5 else "") + \
            f"{rng.choice(('Best regards', 'Kind regards', 'Thanks'))},\n{sender[0]}\n\n"
        return head, tail, by_agent

    statement = (f"Your replacement board left our warehouse today. The tracking number is {value}, and the "
                 f"parcel should reach you within {rng.randint(2, 6)} working days.\n\n")
    final = lambda: message(customer, agent, [_filler(rng, prose)]) + (  # noqa: E731
        "The parcel has still not arrived, and the carrier's website cannot find it. Could you check on your "
        "side? For reference, the tracking number is")
    text, at = _unit_document(rng, tokenizer, unit, statement, final, length, min_distance)
    return _question_at_end(tokenizer, text, at + statement.index(value) - 1, " " + value, length, min_distance,
                            "tracking number")


def minutes_retrieval_prompt(rng: random.Random, tokenizer, prose: list[str], length: int,
                             min_distance: int) -> tuple[list[int], list[int]]:
    """A series of meeting minutes in Markdown (``Present:``, ``## Updates`` of held-out ``prose``
    paragraphs, ``## Decisions``, ``## Actions``) in which a decision, at least ``min_distance``
    tokens before the end, fixes an event's venue (``Ashcombe Hall, 14 Larkspur Road``); the last
    minutes end with ``"- As agreed earlier, the <event> will be held at"`` -> ``(prompt ids, answer
    ids)``, ``length`` prompt tokens; the answer is the venue (with its leading space)."""
    group = rng.choice(("Steering group", "Facilities committee", "Outreach working group", "Programme board"))
    event = rng.choice(("annual symposium", "founders' colloquium", "partners' summit", "regional offsite"))
    value = (f"{rng.choice(VENUE_PLACES)} {rng.choice(VENUE_KINDS)}, {rng.randint(2, 98)} "
             f"{rng.choice(VENUE_STREETS)} {rng.choice(VENUE_WAYS)}")
    people = [" ".join(name) for name in _held_out_names(rng, 6)]
    next_day = _dates(rng, (7, 14))

    def header() -> str:
        present = rng.sample(people, rng.randint(3, 5))
        return (f"# {group} meeting, {next_day():%A %d %B %Y}\n\n"
                f"Present: {', '.join(present)}\n\n")

    def unit(rng):
        head = header() + "## Updates\n\n" + "".join(_filler(rng, prose) + "\n\n" for _ in range(rng.randint(1, 2)))
        head += "## Decisions\n\n" + rng.choice(("- The minutes of the previous meeting were approved.\n",
                                                 "- The budget report was accepted as presented.\n",
                                                 "- No objections were raised to the revised schedule.\n"))
        who = rng.choice(people).split()[0]
        tail = (f"\n## Actions\n\n- {who} to {rng.choice(('circulate the draft', 'book the rooms', 'update the register', 'contact the speakers'))}"
                " before the next meeting.\n\n")
        return head, tail, True

    statement = f"- The {event} will be held at {value}, starting at {rng.randint(9, 14)}:{rng.choice(('00', '30'))}.\n"
    final = lambda: header() + f"## Reminders\n\n- As agreed earlier, the {event} will be held at"  # noqa: E731
    text, at = _unit_document(rng, tokenizer, unit, statement, final, length, min_distance)
    return _question_at_end(tokenizer, text, at + statement.index(value) - 1, " " + value, length, min_distance,
                            "venue")


HELD_OUT_FORMS = {"email": email_retrieval_prompt, "minutes": minutes_retrieval_prompt}
