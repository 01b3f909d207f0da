"""The demo's text: Python's own standard library sources, split **by package**, and their prose.

:data:`HELD_OUT` packages are never trained on (neither the tokenizer nor the models); the demo
concatenates them repository-style (``# file: <path>`` headers, :func:`read_files`) to any length.
The held-in packages are the training code; :func:`prose_paragraphs` reads the prose of
repository-style code (docstrings and comment blocks), :func:`reference_prose` the language
reference topics and the license, and :func:`training_sources` gathers what the real drafter's
training forms (:mod:`fold.demo.forms`) are cut from.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path
from typing import NamedTuple

HELD_OUT = ("asyncio", "email", "json", "xml")
SKIP = {"site-packages", "test", "tests", "encodings", "pydoc_data", "__pycache__", "lib2to3", "turtledemo",
        "ensurepip", "idle_test"}


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



class TrainingSources(NamedTuple):
    """What the training forms are cut from: ``code``, held-in standard-library code (repository-style
    text, :func:`read_files`); ``prose``, paragraphs of held-in prose (:func:`prose_paragraphs` of that
    code, the language reference topics of ``pydoc_data`` and the Python license); ``tests``, the
    standard library's own test modules but those of the held-out packages and of the development
    forms (:func:`training_tests`); ``docs``, the reference topics, IDLE's notes and the license as
    whole texts (:func:`training_docs`)."""
    code: str
    prose: list[str]
    tests: str = ""
    docs: str = ""


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


def reference_topics(root: Path | None = None) -> dict[str, str]:
    """{topic: text} of the language reference topics (``pydoc_data/topics.py``) of the standard library at
    ``root``; empty when absent."""
    topics = (root or stdlib_dir()) / "pydoc_data" / "topics.py"
    if not topics.is_file():
        return {}
    out = {}
    for node in ast.parse(topics.read_text(encoding="utf-8", errors="replace")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            out.update(ast.literal_eval(node.value))
    return out


def reference_prose(root: Path | None = None) -> list[str]:
    """Paragraphs of the language reference topics (``pydoc_data/topics.py``) and ``LICENSE.txt`` of
    the standard library at ``root``; either may be absent."""
    root = root or stdlib_dir()
    out = []
    for text in reference_topics(root).values():
        out += _paragraphs(text)
    license_file = root / "LICENSE.txt"
    if license_file.is_file():
        out += _paragraphs(license_file.read_text(encoding="utf-8", errors="replace"))
    return out


# test modules never trained on: those of the held-out packages and of the real drafter's development forms
# (e-mail messages, decimal test vectors: fold.demo.natural), and any that parse mail
UNTRAINED_TESTS = ("asyncio", "email", "json", "xml", "minidom", "pulldom", "sax", "pyexpat", "expat", "decimal",
                   "mail", "smtp", "imap", "pop", "mime", "nntp", "cppext")


def training_tests(root: Path | None = None) -> str:
    """The standard library's ``test`` modules (``test_*.py`` and the packages ``test_*/``), repository-style,
    but those whose name holds a word of :data:`UNTRAINED_TESTS`; empty without a ``test`` package."""
    root = root or stdlib_dir()
    tests = root / "test"
    if not tests.is_dir():
        return ""
    files = []
    for entry in sorted(tests.iterdir()):
        if not entry.name.startswith("test_") or any(w in entry.name for w in UNTRAINED_TESTS):
            continue
        if entry.is_dir():
            files += sorted(f for f in entry.rglob("*.py") if "__pycache__" not in f.parts)
        elif entry.suffix == ".py":
            files.append(entry)
    return read_files(files, root)


def training_docs(root: Path | None = None) -> str:
    """Whole texts of held-in documentation: the language reference topics (``pydoc_data/topics.py``, each
    under a ``# topic:`` line), IDLE's notes (``idlelib/*.txt``) and the license; any may be absent."""
    root = root or stdlib_dir()
    topics = "".join(f"# topic: {name}\n{text}\n" for name, text in reference_topics(root).items())
    notes = [f for f in sorted((root / "idlelib").glob("*.txt")) + [root / "LICENSE.txt"] if f.is_file()]
    return topics + read_files(notes, root)


def training_sources(root: Path | None = None, held_out=HELD_OUT) -> TrainingSources:
    """The held-in code, prose, tests and documentation of the standard library at ``root`` (the held-out
    packages and the development forms' files are never read into any)."""
    code, _ = split_corpus(root, held_out)
    return TrainingSources(code, prose_paragraphs(code) + reference_prose(root), training_tests(root),
                           training_docs(root))

