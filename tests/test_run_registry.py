"""The run registry (store/runs.py) on a real SQLite index: what it keeps of run ids that name no run, and the
order of reads it keeps while it forgets."""

from __future__ import annotations

import threading

from replay_format import RunShape
from replay_format.rows import RowsMeta
from replay_service.store.index import Index
from replay_service.store.runs import PRUNE_AT, RunRegistry

SHAPE = RunShape(num_moe_layers=2, top_k=2, num_experts=8)


def test_lookups_of_ids_that_name_no_run_leave_nothing_behind(tmp_path):
    """Each 404 used to keep its run id's read number for the life of the process (a dict entry per id ever
    asked for); now they are dropped once no read under way needs them."""
    registry = RunRegistry(Index(tmp_path / "index.sqlite"))
    for i in range(3 * PRUNE_AT):
        assert registry.get(f"absent-{i}") is None
    assert len(registry._applied) <= PRUNE_AT


def test_a_read_under_way_while_its_run_is_forgotten_does_not_bring_it_back(tmp_path):
    """A lookup that read the run's row before the run was deleted applies after the deletion, with thousands of
    other lookups (and their pruning) in between: it answers the run gone, as before the pruning existed."""
    index = Index(tmp_path / "index.sqlite")
    RunRegistry(index).for_batch(RowsMeta("r", "w", 0, SHAPE))  # the run's row, by another registry
    registry = RunRegistry(index)
    read, go = threading.Event(), threading.Event()
    real_run = index.run

    def held_run(run_id: str):
        row = real_run(run_id)
        if run_id == "r":
            read.set()
            go.wait(30)
        return row

    index.run = held_run  # type: ignore[method-assign]
    answers: list = []
    lookup = threading.Thread(target=lambda: answers.append(registry.get("r")))
    lookup.start()
    assert read.wait(30)  # its row read: the run is there
    with index.transaction() as tx:
        tx.delete_run("r")
    registry.forget("r")
    for i in range(3 * PRUNE_AT):
        registry.get(f"absent-{i}")
    go.set()
    lookup.join(30)
    assert answers == [None]
    index.run = real_run  # type: ignore[method-assign]
    assert registry.get("r") is None
