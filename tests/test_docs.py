"""The front door stays a front door: README within 200 lines, and every relative link in README.md,
docs/ and the READMEs beside the code resolves (to a file, and to a heading where it names one)."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "fold" / "kernels" / "README.md",
        ROOT / "fold" / "demo" / "artifacts" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    links = [m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith(("http://", "https://", "mailto:"))]
    assert links, f"{doc} links nowhere (is the pattern right?)"
    for link in links:
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.relative_to(ROOT)}: {link} -> {path} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.relative_to(ROOT)}: {link}: no heading #{anchor} in {path.name}"


PATH_IN_CODE = re.compile(r"`([\w.\-]+(?:/[\w.\-<>]*)+)`")
# every top-level folder of the repository (a path README names under any of them must exist)
ROOTS = ("fold/", "reference/", "tests/", "tuning/", "benchmarks/", "tools/", "results/", "examples/", "docs/", ".ci/")


def test_readme_names_only_files_that_exist():
    paths = [m.group(1) for m in PATH_IN_CODE.finditer((ROOT / "README.md").read_text()) if m.group(1).startswith(ROOTS)]
    assert len(paths) > 10, "the pattern found almost no paths in README (is it right?)"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README names paths that do not exist: {missing}"


@pytest.mark.parametrize("module, public", [("fold.fold_attention", "attention"), ("fold.hybrid_tree", "tree_attention")])
def test_public_functions_do_not_shadow_their_modules(module, public):
    import importlib
    import types

    import fold
    mod = importlib.import_module(module)
    assert isinstance(mod, types.ModuleType) and getattr(fold, public) is getattr(mod, public)
    leaf = module.rsplit(".", 1)[1]
    assert isinstance(getattr(fold, leaf), types.ModuleType), f"fold.{leaf} is not the module {module}"


def test_the_loop_is_not_called_spec():
    import importlib.util
    assert importlib.util.find_spec("fold.spec") is None
    assert importlib.util.find_spec("fold.spec_decode") is not None


def _long_functions(limit: int = 80) -> list[str]:
    """Functions (methods included) whose body, docstring left out, spans more than ``limit`` lines
    (every line after the signature and the docstring counts: code, comments and blank lines), in every
    Python file of the repository outside virtual environments; ``@triton.jit`` kernels are exempt (a
    kernel's loop is one stage)."""
    import ast

    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            body = node.body
            first = body[0].lineno                      # the body's first line (comments above it included)
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
                first = body[0].end_lineno + 1          # the line after the docstring
            else:
                while first - 1 > node.lineno and lines[first - 2].strip().startswith("#"):
                    first -= 1
            count = node.end_lineno - first + 1
            if count > limit:
                found.append(f"{rel}:{node.lineno} {node.name} ({count} lines)")
    return found


def test_no_function_is_longer_than_80_lines():
    assert not _long_functions(), _long_functions()


def test_the_length_rule_sees_a_long_function(tmp_path, monkeypatch):
    (tmp_path / "long.py").write_text("def f():\n    '''doc'''\n" + "    x = 1\n" * 81)
    (tmp_path / "short.py").write_text("def g():\n" + "    x = 1\n" * 80)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _long_functions() == ["long.py:1 f (81 lines)"]


def test_the_length_rule_counts_comments_and_blank_lines_but_not_the_docstring(tmp_path, monkeypatch):
    body = "    # a comment\n\n" + "    x = 1\n\n" * 39 + "    x = 1\n"    # 81 lines, 40 of them code
    (tmp_path / "airy.py").write_text("def f(\n    a,\n):\n    '''a\n    long\n    doc'''\n" + body)
    (tmp_path / "documented.py").write_text("def g():\n    '''a\n" + "    doc line\n" * 200 + "    '''\n"
                                            + "    x = 1\n" * 80)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _long_functions() == ["airy.py:1 f (81 lines)"]
