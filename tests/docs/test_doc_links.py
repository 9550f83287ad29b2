"""Every link of README.md and docs/ resolves: relative links to a file of the repository, anchors to a
heading of their page; web links are checked for form only (the tests use no network)."""

from __future__ import annotations

from urllib.parse import unquote, urlparse

import pytest

from tests.docs.markdown_blocks import PAGES, ROOT, anchors, links, slug

README_LIMIT = 10_000


def _problem(page, target: str) -> str | None:
    if "://" in target or target.startswith("mailto:"):
        url = urlparse(target)
        if url.scheme not in ("http", "https", "mailto") or (url.scheme != "mailto" and "." not in url.netloc):
            return f"malformed web link {target}"
        return None
    path, _, anchor = target.partition("#")
    file = (page.parent / unquote(path)).resolve() if path else page
    if not file.is_relative_to(ROOT):
        return f"{target} leaves the repository"
    if not file.exists():
        return f"{target}: no such file"
    if anchor:
        if file.suffix != ".md":
            return f"{target}: an anchor into a file that is not Markdown"
        if anchor not in anchors(file):
            return f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves(page) -> None:
    found = links(page)
    problems = [p for p in (_problem(page, t) for t in found) if p]
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_links_are_found() -> None:
    """The link reader sees the README's links (a parser that found none would pass every page)."""
    readme = links(ROOT / "README.md")
    assert "docs/getting-started.md" in readme and len(readme) >= 20


def test_anchors_follow_github() -> None:
    assert slug("Which `--sync-policy` a volunteer swarm should use") == "which---sync-policy-a-volunteer-swarm-should-use"
    assert slug("8. DiLoCo: inner steps, then an outer step") == "8-diloco-inner-steps-then-an-outer-step"
    assert slug("Byzantine workers × aggregators") == "byzantine-workers--aggregators"
    assert _problem(ROOT / "README.md", "docs/library.md#no-such-heading") is not None
    assert _problem(ROOT / "README.md", "docs/no-such-page.md") is not None


def test_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_text())
    assert size <= README_LIMIT, f"README.md has {size} characters; move detail into docs/ (limit {README_LIMIT})"


def test_readme_indexes_every_page_of_docs() -> None:
    readme = set(links(ROOT / "README.md"))
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md's documentation index lacks {missing}"
