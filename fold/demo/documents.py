"""The toy pair's training documents: code and generated copy documents, as text and as BPE tokens.

- Code: held-in standard-library code (:mod:`fold.demo.corpus`).
- Key-value documents: ``key_NN: v1 v2`` lines (two random 8-hex words); later lines repeat an
  earlier entry, so predicting the value of a repeated key needs retrieval by content.
- Repeated-line documents: lines of code, some repeated verbatim later.
- Random-string documents: lines of random identifiers and hex strings, some repeated far later.

The generated documents are where copying is the only way to predict: a random value can only be
known by finding where it was stored (:func:`fold.demo.tokens.copy_mask` marks those positions).
"""

from __future__ import annotations

import random

from fold.demo.tokens import encode

HEX = "0123456789abcdef"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def random_word(rng: random.Random, lo: int = 4, hi: int = 9) -> str:
    """``lo`` to ``hi`` random lowercase letters."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def random_hex(rng: random.Random, n: int = 8) -> str:
    """``n`` random hex digits."""
    return "".join(rng.choice(HEX) for _ in range(n))


def kv_line(rng: random.Random) -> str:
    """One new entry of a key-value document: ``key_NN: v1 v2`` (two 8-hex words) and a line break."""
    return f"{random_word(rng)}_{rng.randint(0, 99)}: {random_hex(rng)} {random_hex(rng)}\n"


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
            line = kv_line(rng)
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
            words = [(random_hex(rng, rng.randint(4, 12)) if rng.random() < 0.4 else random_word(rng, 3, 10))
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

