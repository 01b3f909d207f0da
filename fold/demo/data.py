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

The tokenizer (:func:`train_tokenizer`) is a byte-level BPE trained with Hugging Face ``tokenizers``
on the training split; its pre-tokenizer keeps identifiers and hex words whole (``[A-Za-z0-9_]+``
with an optional leading space), so one token stands for a word piece, not a byte.
"""

from __future__ import annotations

import random
import sysconfig
from collections import Counter
from pathlib import Path

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
    ids = encode(tokenizer, full)
    plant_at = len(encode(tokenizer, window[:cut]))
    prompt = ids[max(0, len(ids) - length):]
    if len(ids) - plant_at > len(prompt) or len(ids) - plant_at < min_distance:
        raise ValueError(f"the planted line is {len(ids) - plant_at} tokens back in a {len(prompt)}-token prompt; "
                         f"wanted at least {min_distance}")
    answer = encode(tokenizer, full + f'{value}"')[len(ids):]
    return prompt, answer
