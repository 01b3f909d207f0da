"""Natural copy forms: real text from disk in which later text repeats earlier text by itself, nothing
planted, and prompts cut where the text goes on by repeating a span found only far back.

:data:`DEV_FORMS` are the real drafter's **development forms**, read by the evaluation and never by
its training (the training's sources, :func:`fold.demo.corpus.training_sources`, skip the standard
library's ``test`` package and read nothing outside the standard library;
``tests/demo/test_natural.py`` checks that no development text is in them):

- ``mail``: the e-mail messages the standard library's e-mail tests parse
  (``test/test_email/data/msg_*.txt``), concatenated as a mailbox: headers, addresses, MIME
  boundaries and quoted replies recur;
- ``cpp``: the C++ headers of c10 shipped in the installed ``torch`` wheel (``torch/include/c10``),
  repository-style: type, macro and namespace names recur across files;
- ``dectest``: the General Decimal Arithmetic test vectors (``test/decimaltestdata/*.decTest``):
  directives, operands and file headers recur.

Each is read in sorted file order up to :data:`MAX_CHARS` characters, so a machine with the same
Python (3.11.7 here) and torch (2.13.0) builds the same prompts. :func:`far_repeat_prompts` cuts
prompts at a *far repeat*: the text right after the cut repeats, token for token, a span whose
nearest earlier occurrence lies at least ``min_distance`` tokens back (beyond any window a drafter
reads at true positions), so only a read of the far context can draft it.
"""

from __future__ import annotations

import random
from pathlib import Path

from fold.demo.corpus import stdlib_dir
from fold.demo.tokens import encode

DEV_FORMS = ("mail", "cpp", "dectest")
DEV_SOURCES = {"mail": "the standard library's test/test_email/data/msg_*.txt",
               "cpp": "torch/include/c10/**/*.h of the installed torch",
               "dectest": "the standard library's test/decimaltestdata/*.decTest"}
MAX_CHARS = 1_000_000          # characters read per form (sorted file order)
SPAN = 16                      # tokens a far repeat matches at least
ANSWER = 12                    # of them, the tokens the target must reproduce (after 1-4 already in the prompt)


def dev_files(form: str, root: Path | None = None, torch_include: Path | None = None) -> list[Path]:
    """The files of a development form, sorted (``root``: the standard library, ``torch_include``: the
    installed torch's ``include`` folder); raises ``FileNotFoundError`` naming what is missing."""
    root = root or stdlib_dir()
    if form == "mail":
        files = sorted((root / "test" / "test_email" / "data").glob("msg_*.txt"))
    elif form == "dectest":
        files = sorted((root / "test" / "decimaltestdata").glob("*.decTest"))
    elif form == "cpp":
        if torch_include is None:
            import torch

            torch_include = Path(torch.__file__).parent / "include"
        files = sorted(f for f in (torch_include / "c10").rglob("*") if f.suffix in (".h", ".hpp"))
    else:
        raise ValueError(f"unknown development form {form!r}; expected one of {DEV_FORMS}")
    if not files:
        raise FileNotFoundError(f"development form {form!r}: none of its files found ({DEV_SOURCES[form]})")
    return files


def dev_text(form: str, root: Path | None = None, torch_include: Path | None = None,
             max_chars: int = MAX_CHARS) -> str:
    """A development form's text, at most ``max_chars`` characters: messages joined as a mailbox
    (``From`` separator lines), headers and test files repository-style (``// file:`` or ``-- file:``
    headers)."""
    files = dev_files(form, root, torch_include)
    base = files[0].parents[1] if form == "cpp" else files[0].parent
    parts, size = [], 0
    for f in files:
        body = f.read_text(encoding="utf-8", errors="replace")
        if form == "mail":
            head = f"From MAILER-DAEMON {f.name}\n"
        elif form == "cpp":
            head = f"// file: {f.relative_to(base)}\n"
        else:
            head = f"-- file: {f.name}\n"
        parts.append(head + body + ("" if body.endswith("\n") else "\n") + "\n")
        size += len(parts[-1])
        if size >= max_chars:
            break
    return "".join(parts)[:max_chars]


def repeat_starts(ids: list[int], span: int = SPAN) -> list[tuple[int, int]]:
    """Every repeat of ``ids`` as ``(c, s)``: ``ids[c:c + span] == ids[s:s + span]`` with ``s`` the nearest
    earlier start of that span, and the repeat starting at ``c`` (``ids[c - 1] != ids[s - 1]``)."""
    last: dict[tuple, int] = {}
    out = []
    for c in range(len(ids) - span + 1):
        gram = tuple(ids[c:c + span])
        s = last.get(gram)
        last[gram] = c
        if s is not None and (s == 0 or ids[c - 1] != ids[s - 1]):
            out.append((c, s))
    return out


def far_repeats(ids: list[int], length: int, min_distance: int, span: int = SPAN) -> list[tuple[int, int]]:
    """The repeats ``(c, s)`` of :func:`repeat_starts` a ``length``-token prompt cut up to 4 tokens after ``c``
    can hold far back: ``c >= length``, ``min_distance <= c - s <= length - 4``."""
    return [(c, s) for c, s in repeat_starts(ids, span) if c >= length and min_distance <= c - s <= length - 4]


def far_repeat_prompts(rng: random.Random, ids: list[int], length: int, count: int, min_distance: int,
                       span: int = SPAN, answer: int = ANSWER) -> list[tuple[list[int], list[int]]]:
    """``count`` prompts ``(prompt ids [length], answer ids [answer])`` cut 1-4 tokens into distinct far
    repeats of ``ids`` (:func:`far_repeats`), drawn with ``rng``; the answer is how the repeat goes on.
    Raises ``ValueError`` when ``ids`` holds fewer than ``count`` far repeats."""
    if answer + 4 > span:
        raise ValueError(f"answer ({answer}) + 4 must be at most span ({span})")
    found = far_repeats(ids, length, min_distance, span)
    if len(found) < count:
        raise ValueError(f"{len(found)} far repeats at distance >= {min_distance} in {len(ids)} tokens "
                         f"for {length}-token prompts; {count} wanted")
    out = []
    for c, _ in rng.sample(found, count):
        cut = c + rng.randint(1, 4)
        out.append((ids[cut - length:cut], ids[cut:cut + answer]))
    return out


_IDS: dict = {}


def dev_ids(form: str, tokenizer) -> list[int]:
    """A development form's text as ``tokenizer``'s ids (kept per form and tokenizer object)."""
    key = (form, id(tokenizer))
    if key not in _IDS or _IDS[key][0] is not tokenizer:
        _IDS[key] = (tokenizer, encode(tokenizer, dev_text(form)))
    return _IDS[key][1]
