"""The README and the documentation site: short README, links that resolve, a site that builds.

Every relative link and image in README.md and docs/ must point at a file of the checkout, and
every ``#anchor`` at a heading of its target page: as GitHub names headings for the README, and
for docs/ pages (read on GitHub and in the built site) as both GitHub and mkdocs name them. The
site itself must build with ``mkdocs build --strict`` (broken links, missing anchors and pages
left out of the nav fail it), and docs/options.md must be what docs/gen_options.py generates.
"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify as mkdocs_slugify

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose_lines(text: str, *, keep_code: bool = False) -> list[str]:
    """The lines outside fenced code blocks, inline code spans blanked out unless kept."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line if keep_code else _CODE_SPAN.sub("", line))
    return lines


def _heading_text(raw: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # a link in a heading: its text
    return text.replace("`", "")


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = unicodedata.normalize("NFKC", _heading_text(text)).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path, *, mkdocs: bool) -> set[str]:
    """The anchors of a page's headings, as GitHub or as mkdocs (Python-Markdown) names them."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(page.read_text(), keep_code=True):
        match = _HEADING.match(line)
        if not match:
            continue
        text = match.group(2)
        base = mkdocs_slugify(_heading_text(text), "-") if mkdocs else github_slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        # A repeated heading: GitHub appends -1, -2…; Python-Markdown _1, _2….
        anchors.add(base if n == 0 else f"{base}{'_' if mkdocs else '-'}{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(page.read_text()) for m in _LINK.finditer(line)]


def _problems(page: Path) -> list[str]:
    problems = []
    in_docs = DOCS in page.parents
    for target in _links(page):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}: {target}"
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{where} leaves the checkout")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if in_docs and DOCS not in dest.parents:
            problems.append(
                f"{where}: a docs/ page may link only inside docs/ (the site has no more)"
            )
            continue
        if anchor:
            if dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not Markdown")
                continue
            if anchor not in _anchors(dest, mkdocs=False):
                problems.append(f"{where}: no heading with GitHub's anchor #{anchor}")
            if in_docs and anchor not in _anchors(dest, mkdocs=True):
                problems.append(f"{where}: no heading with mkdocs' anchor #{anchor}")
    return problems


def test_readme_is_short() -> None:
    """The README stays a front page (at most 250 lines); the manual lives in docs/."""
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the detail into a docs/ page"


def test_link_checker_sees_links() -> None:
    """The checker finds links, images and anchors where they are, and none inside code."""
    text = "[a](x.md#y) ![img](p.png) `[no](z.md)`\n```\n[no](w.md)\n```\n[b](https://e.org)\n"
    links = [m.group(1) for line in _prose_lines(text) for m in _LINK.finditer(line)]
    assert links == ["x.md#y", "p.png", "https://e.org"]
    assert github_slug("Fan-out (`--fanout on`, a `b_c`)") == "fan-out---fanout-on-a-b_c"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link and image of the page resolves, anchors included."""
    assert _problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_escaped_pipe_in_table_code(page: Path) -> None:
    """No table cell holds `a\\|b` in code: GitHub shows a pipe, the built site a backslash too."""
    rows = [ln for ln in _prose_lines(page.read_text(), keep_code=True) if ln.startswith("|")]
    bad = [ln for ln in rows for span in _CODE_SPAN.finditer(ln) if "\\|" in span.group(0)]
    assert bad == []


def test_every_docs_page_is_linked_from_the_readme_or_the_nav() -> None:
    """No page of docs/ is an orphan: the site's nav names every one of them."""
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [
        p.relative_to(DOCS).as_posix() for p in PAGES if p.relative_to(DOCS).as_posix() not in nav
    ]
    assert missing == []


def test_options_page_is_generated_from_the_declarations() -> None:
    """docs/options.md is exactly what docs/gen_options.py writes from the option table."""
    done = subprocess.run(
        [sys.executable, str(DOCS / "gen_options.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict`` builds the whole site with no warning (links, anchors, nav)."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "options.html").is_file()
