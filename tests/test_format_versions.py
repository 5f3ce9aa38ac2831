"""Each format's spec says its module's version (replay_format/README.md): the title names the current
`format_version`, and the spec's "Version history" has a row for it (a version bumped in the module and not in the
spec, as step frames 1.4 once was, fails here)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from replay_format.core import FormatVersion

FORMATS = Path(__file__).resolve().parent.parent / "replay_format"
# spec -> the versions its module writes (segments: by layer and by rows)
VERSIONED = {
    "rows.md": ("rows", ("VERSION",)),
    "segment.md": ("segment", ("VERSION", "ROWS_VERSION")),
    "route.md": ("route", ("VERSION",)),
    "compare.md": ("compare", ("VERSION",)),
    "trainer_query.md": ("trainer_query", ("VERSION",)),
    "trainer_slice.md": ("trainer_slice", ("VERSION",)),
    "step_frame.md": ("step_frame", ("VERSION",)),
    "journal.md": ("journal", ("VERSION",)),
    "spill.md": ("spill", ("VERSION",)),
    "request_notes.md": ("request_notes", ("VERSION",)),
    "trajectory.md": ("trajectory", ("VERSION",)),
}


def history(text: str) -> str:
    """The spec's "Version history" section."""
    start = text.index("\n## Version history\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_spec_is_listed_and_has_a_history() -> None:
    specs = {p.name for p in FORMATS.glob("*.md")} - {"README.md"}
    assert specs == set(VERSIONED) | {"vllm_response.md"}
    for name in specs:
        assert "\n## Version history\n" in (FORMATS / name).read_text(), name


@pytest.mark.parametrize("spec", sorted(VERSIONED))
def test_spec_says_the_modules_version(spec: str) -> None:
    module, names = VERSIONED[spec]
    text = (FORMATS / spec).read_text()
    title, rows = text.splitlines()[0], history(text)
    for name in names:
        version = getattr(importlib.import_module(f"replay_format.{module}"), name)
        assert isinstance(version, FormatVersion)
        assert re.search(rf"\b{re.escape(str(version))}\b", title), (spec, title, str(version))
        assert re.search(rf"^\| (?:[\d., ]*, )?{re.escape(str(version))}\b", rows, re.M), (spec, str(version))
