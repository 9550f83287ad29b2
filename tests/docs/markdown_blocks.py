"""Reading the documentation's Markdown: fenced blocks with their doc-test markers, links, headings.

A block a test cannot run here says why on the line before it, as an HTML comment that renders as
nothing: `<!-- doc-test: skip CATEGORY: reason -->`, CATEGORY one of SKIP_CATEGORIES.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
SKIP_CATEGORIES = {
    "remote": "needs a swarm or address elsewhere",
    "docker": "needs docker",
    "gpu": "needs a GPU",
    "network": "downloads from the internet",
    "long": "runs for minutes",
    "root": "needs root (network namespaces)",
}

_FENCE = re.compile(r"^```([\w+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
_SKIP = re.compile(r"^skip\s+(\w+):\s*(\S.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # the doc-test comment's text right before the fence, if any

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str | None:
        return "shell" if self.lang in SHELL else "python" if self.lang in PYTHON else None

    @property
    def skip(self) -> tuple[str, str] | None:
        """(category, reason) of a skip marker; None if the block runs. A malformed marker raises."""
        if self.marker is None:
            return None
        found = _SKIP.match(self.marker)
        if not found:
            raise ValueError(f"{self.id}: doc-test marker {self.marker!r} is not 'skip CATEGORY: reason'")
        category, reason = found.groups()
        if category not in SKIP_CATEGORIES:
            raise ValueError(f"{self.id}: skip category {category!r} is not one of {sorted(SKIP_CATEGORIES)}")
        return category, reason


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page` (top-level fences only), with the doc-test marker before it."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not re.match(r"^```\s*$", lines[i]):
            i += 1
        if i == len(lines):
            raise ValueError(f"{page.relative_to(ROOT)}:{start + 1}: fenced block never closed")
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _MARKER.match(lines[before].strip()) if before >= 0 else None
        found.append(Block(page, start + 1, opening.group(1).lower(), "\n".join(lines[start + 1 : i]) + "\n",
                           marker.group(1) if marker else None))
        i += 1
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```[\w+-]*\s*$.*?^```\s*$", "", page.read_text(), flags=re.S | re.M)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on `page`, repeated headings numbered as GitHub does (-1, -2, …)."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    text = re.sub(r"^```[\w+-]*\s*$.*?^```\s*$", "", page.read_text(), flags=re.S | re.M)
    for line in text.splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result
