"""The front door stays a front door: README within 200 lines, and every relative link in README.md,
docs/ and the READMEs beside the code resolves (to a file, and to a heading where it names one)."""

import re
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
