"""A row's walk through the service climbs back up no floor: POST /v1/ingest and a trainer rank's read, traced.

The floors are pyproject.toml's layer contracts (tests/support/walk.py). Import contracts keep a floor from
importing a higher one; this keeps a lower floor from calling back up through an object it was handed (the store
once held the ingest pipeline and called it: api -> store -> ingest -> store).
"""

from __future__ import annotations

import pytest

from tests.support.walk import walks


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    return walks(tmp_path_factory.mktemp("walk") / "data")


@pytest.mark.parametrize("name", ["ingest", "trainer read"])
def test_the_walk_never_climbs_back_up(traced, name):
    walk = traced[name]
    assert walk.places, "nothing traced"
    assert walk.climbs == [], "\n".join(f"{s.caller} -> {s.callee}" for s in walk.climbs)

