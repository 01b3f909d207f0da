"""Text for the demo: Python's own standard library sources and generated retrieval documents.

Everything is bytes (the demo models are byte-level: token = byte, 256 = the drafter's MASK).

- Code: ``.py`` files of the standard library found on this machine, split **by package**:
  :data:`HELD_OUT` packages are never trained on; the demo concatenates them repository-style
  (``# file: <path>`` headers) to any length.
- Key-value documents: ``key: value`` lines; later lines repeat an earlier entry (up to
  ``reach`` entries back), so predicting the value of a repeated key needs retrieval by content.
- Repeated-line documents: lines of code, some repeated verbatim later.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

HELD_OUT = ("asyncio", "email", "json", "xml")
SKIP = {"site-packages", "test", "tests", "encodings", "pydoc_data", "__pycache__", "lib2to3", "turtledemo",
        "ensurepip", "idle_test"}
HEX = "0123456789abcdef"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


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


def read_files(files: list[Path], root: Path | None = None) -> bytes:
    """Repository-style concatenation: a ``# file: <path>`` header before each file."""
    root = root or stdlib_dir()
    parts = []
    for f in files:
        try:
            parts.append(f"# file: {f.relative_to(root)}\n".encode() + f.read_bytes() + b"\n")
        except OSError:
            continue
    return b"".join(parts)


def _held_out(packages: dict[str, list[Path]], root: Path | None, held_out) -> dict[str, bytes]:
    missing = [p for p in held_out if p not in packages]
    if missing:
        raise ValueError(f"held-out packages {missing} not found under {root or stdlib_dir()}")
    return {name: read_files(packages[name], root) for name in held_out}


def held_out_code(root: Path | None = None, held_out=HELD_OUT) -> dict[str, bytes]:
    """{held-out package: its code}, without reading the training packages."""
    return _held_out(package_files(root), root, held_out)


def split_corpus(root: Path | None = None, held_out=HELD_OUT) -> tuple[bytes, dict[str, bytes]]:
    """(training code, {held-out package: its code}); raises if a held-out package is missing."""
    packages = package_files(root)
    held = _held_out(packages, root, held_out)
    return read_files([f for name, fs in packages.items() if name not in held_out for f in fs], root), held


def _word(rng: random.Random, lo: int = 4, hi: int = 9) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _value(rng: random.Random) -> str:
    return " ".join("".join(rng.choice(HEX) for _ in range(8)) for _ in range(2))


def kv_document(rng: random.Random, length: int, reach: int = 60, repeat_p: float = 0.35) -> bytes:
    """``key: v1 v2`` lines (two 8-hex words); with probability ``repeat_p`` a line repeats one of
    the last ``reach`` entries verbatim. About ``length`` bytes."""
    entries: list[str] = []
    lines: list[str] = []
    size = 0
    while size < length:
        if entries and rng.random() < repeat_p:
            line = rng.choice(entries[-reach:])
        else:
            line = f"{_word(rng)}_{rng.randint(0, 99)}: {_value(rng)}\n"
            entries.append(line)
        lines.append(line)
        size += len(line)
    return "".join(lines).encode()


def repeated_lines_document(rng: random.Random, code: bytes, length: int, reach: int = 40) -> bytes:
    """Lines drawn from ``code``; a third of them repeat one of the last ``reach`` lines verbatim."""
    out: list[bytes] = []
    size = 0
    while size < length:
        if len(out) > 2 and rng.random() < 0.35:
            line = rng.choice(out[-reach:])
        else:
            start = rng.randrange(0, max(1, len(code) - 200))
            nl = code.find(b"\n", start)
            end = code.find(b"\n", nl + 1)
            line = code[nl + 1:end + 1] if nl >= 0 and end > nl else b"pass\n"
        out.append(line)
        size += len(line)
    return b"".join(out)


def training_sample(rng: random.Random, code: bytes, length: int, mix=(0.6, 0.25, 0.15)) -> bytes:
    """One ``length``-byte training window: code, a key-value document or a repeated-line document."""
    u = rng.random()
    if u < mix[0]:
        start = rng.randrange(0, len(code) - length)
        return code[start:start + length]
    if u < mix[0] + mix[1]:
        return kv_document(rng, length, reach=rng.choice([8, 20, 60]))[:length]
    return repeated_lines_document(rng, code, length)[:length]


def retrieval_prompt(rng: random.Random, length: int, min_distance: int) -> bytes:
    """A key-value document of about ``length`` bytes (no repeats) ending with ``"<key>:"`` for a key
    stored at least ``min_distance`` bytes earlier: the answer is that entry's value."""
    lines = kv_document(rng, length - 24, repeat_p=0.0).decode().splitlines(keepends=True)
    total = sum(map(len, lines))
    far, offset = [], 0
    for line in lines:
        if total - offset >= min_distance and offset >= 64:
            far.append(line)
        offset += len(line)
    if not far:
        raise ValueError(f"length {length} is too short for a key {min_distance} bytes back")
    key = rng.choice(far).split(":")[0]
    return ("".join(lines) + f"{key}:").encode()


def code_prompt(held_out: dict[str, bytes], rng: random.Random, length: int) -> bytes:
    """``length`` bytes of a held-out package, cut at a line start (repository-style concatenation)."""
    name = rng.choice(sorted(held_out))
    text = held_out[name]
    if len(text) < length:
        text = b"".join(held_out[n] for n in sorted(held_out))
    start = rng.randrange(0, len(text) - length)
    nl = text.find(b"\n", start)
    start = nl + 1 if 0 <= nl < len(text) - length else start
    return text[start:start + length]
