"""Fenced code blocks of a Markdown page, with the comment on the line above each: what the docs tests run; and
the page's lines outside them, where the link tests look for headings and links.

`<!-- not run: REASON -->` above a fence says why a block is not run; `<!-- run: continues -->` joins it to the
page's previous run block (tests/test_docs_examples.py); other markers (the README's `<!-- quickstart -->`) are
read from `Block.above`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>[^>]*?)\s*-->")
_CONTINUES = re.compile(r"<!--\s*run:\s*continues\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: where, its language, its code and what the comment above it says."""

    page: str
    line: int  # 1-based, the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason given, "" when the marker has none
    continues: bool
    above: str  # the line right above the opening fence, stripped
    closed: bool  # False: the page ends inside it

    @property
    def where(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.page}:{self.line} ({first[:60]!r})"


def _spans(lines: list[str]) -> Iterator[tuple[int, int, re.Match]]:
    """Each fenced block as (its opening line's index, its closing line's index or len(lines) when the text ends
    inside it, the opening fence's match); a fence closes only on a line of the same character, as long or longer."""
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m["fence"], i
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            i += 1
        yield start, i, m
        i += 1


def blocks_of(text: str, page: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order (nested fences inside a longer fence are code)."""
    lines = text.splitlines()
    out: list[Block] = []
    for start, end, m in _spans(lines):
        indent = len(m["indent"])
        body = [line[indent:] if line[:indent].isspace() else line for line in lines[start + 1:end]]
        above = lines[start - 1] if start > 0 else ""
        marker = _NOT_RUN.search(above)
        out.append(Block(page, start + 1, m["lang"].lower(), "\n".join(body) + "\n",
                         marker["reason"] if marker else None, bool(_CONTINUES.search(above)), above.strip(),
                         end < len(lines)))
    return out


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside its fenced blocks (fences included), in order: where headings and
    links are."""
    lines = text.splitlines()
    code = {i for start, end, _ in _spans(lines) for i in range(start, end + 1)}
    return [line for i, line in enumerate(lines) if i not in code]
