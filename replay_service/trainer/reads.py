"""One rank's trainer slice: plan its tokens (`plans.py`), read only their rows from the store, build the answer.

The answer is a trainer slice (replay_format/trainer_slice.md): one row per router token
of the rank, in the router's order. Padding and last tokens get `layouts.filler_rows` and
`valid == 0`; a real token whose row is flagged or missing follows the query's
`MissingPolicy` (`gather.py`): refused (strict, the default), left to the router, or filler.
Each replayed token carries its row's weight version; `versions=single` refuses sequences that mix
versions (`versions.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay_format import ID_RULE, flag_names, valid_id
from replay_format.trainer_query import SequenceRef, TrainerQuery, VersionPolicy, strict_alias
from replay_format.trainer_slice import MissingPolicy, SliceMeta, build_slice
from replay_format.weight_versions import WeightVersions
from replay_service.errors import Conflict, InvalidInput, StrictRefusal
from replay_service.store import RouteStore
from replay_service.store.requests.rows import RouteRows
from replay_service.store.requests.summaries import RequestRecord
from replay_service.store.runs import RunState
from replay_service.trainer import layouts
from replay_service.trainer.gather import (
    DenseIds,
    Gathered,
    HeldLayers,
    IdRows,
    RowsRead,
    gather_rows,
    held_layers,
)
from replay_service.trainer.plans import SliceLimits, planner
from replay_service.trainer.versions import VersionLabels, mixed_versions, refuse_mixed


@dataclass
class SliceAnswer:
    """A built slice: the Arrow stream in parts (the gathered arrays' own buffers, uncopied) and two counts."""

    parts: list[memoryview]
    tokens: int
    valid: int

    @property
    def size(self) -> int:
        """Bytes of the whole stream."""
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class StoredSequence:
    """One sequence of the micro-batch: what the query names, its run and request as taken before their rows are
    read (`RouteStore.read_rows`), its tokens and rows."""

    ref: SequenceRef
    run: RunState
    request: RequestRecord
    spec: layouts.SequenceSpec


def read_slice(store: RouteStore, query: TrainerQuery, limits: SliceLimits) -> SliceAnswer:
    """The slice of one rank: its tokens planned as its trainer lays them out (`plans.planner`), their rows read.

    InvalidInput, TooLarge, NotFound, Conflict or StrictRefusal say why a query is refused.
    """
    make_plan = planner(query, limits)
    missing = missing_policy(query.missing, query.strict)
    refs = query.sequences
    if not refs:
        raise InvalidInput("a micro-batch needs at least one sequence")
    if len(refs) > limits.max_sequences:
        raise InvalidInput(f"{len(refs)} sequences exceeds max_batch_requests={limits.max_sequences}")
    for ref in refs:
        for kind, value in (("run id", ref.run), ("request id", ref.request)):
            if not valid_id(value):
                raise InvalidInput(f"{kind} {value!r} is not a valid id: {ID_RULE}")
    runs = micro_batch_runs(store, refs)
    shape = runs[refs[0].run].shape
    held = held_layers(shape, query.layers)
    seqs = stored_sequences(store, refs, runs)
    specs = [s.spec for s in seqs]
    plan = make_plan(specs)
    if plan.num_tokens > limits.max_tokens:
        raise InvalidInput(
            f"this rank's slice is {plan.num_tokens} tokens, more than one read returns "
            f"(REPLAY_MAX_READ_ROWS={limits.max_tokens}); use smaller micro-batches")
    whole = whole_sequences(store, seqs) if query.versions is VersionPolicy.SINGLE else {}
    refuse_mixed([m for i, route in whole.items() if (m := mixed_versions(i, seqs[i].ref, route)) is not None],
                 limits.strict_report_rows)
    labels = VersionLabels()
    got = gather(store, seqs, plan, held, missing, limits.strict_report_rows, labels, whole)
    starts = np.array([s.start for s in specs], np.int64)
    position = np.where(plan.sequence >= 0, starts[np.maximum(plan.sequence, 0)] + plan.offset, -1).astype(np.int32)
    meta = SliceMeta(top_k=shape.top_k, num_experts=shape.num_experts, moe_ordinals=held.moe_ordinals.tolist(),
                     moe_layers=held.moe_layers, layout=plan.layout, layer_axis=held.axis, layers=held.layers,
                     num_hidden_layers=shape.num_hidden_layers, missing=missing, weight_versions=labels.labels)
    parts = build_slice(meta, got.experts, got.valid, plan.sequence, position, got.fallback, got.version)
    return SliceAnswer(parts, plan.num_tokens, int(got.valid.sum()))


def missing_policy(missing: MissingPolicy | None, strict: bool | None) -> MissingPolicy:
    """The policy a query asks for: `missing`, or what the older `strict` flag meant; strict when neither is given.

    `strict` (every client before slice 1.1 sends it) is an alias: true = strict, false = filler.
    InvalidInput when both are given and disagree.
    """
    if strict is None:
        return missing or MissingPolicy.STRICT
    alias = strict_alias(strict)
    if missing is not None and missing is not alias:
        raise InvalidInput(f"strict={str(strict).lower()} (an alias of missing={alias.value}) contradicts "
                           f"missing={missing.value}; give missing only")
    return alias


def micro_batch_runs(store: RouteStore, refs: tuple[SequenceRef, ...]) -> dict[str, RunState]:
    """Each run the micro-batch names, taken once (`RouteStore.run_to_read`: before any of its requests), in the
    order named; NotFound for a missing one, Conflict when one's shape differs from the first run's."""
    runs: dict[str, RunState] = {}
    for ref in refs:
        if ref.run in runs:
            continue
        runs[ref.run] = run = store.run_to_read(ref.run)
        shape, s = runs[refs[0].run].shape, run.shape
        if s != shape:
            raise Conflict(
                f"run {ref.run!r} records {s.num_moe_layers} x top-{s.top_k} of {s.num_experts} (MoE layers "
                f"{list(s.moe_layers)}), unlike the micro-batch's first run; one micro-batch needs one model shape")
    return runs


def stored_sequences(store: RouteStore, refs: tuple[SequenceRef, ...],
                     runs: dict[str, RunState]) -> list[StoredSequence]:
    """Each sequence's request and rows, checked against the length rule (`layouts.sequence_spec`); `runs` are
    the micro-batch's (`micro_batch_runs`), taken before these requests (one index query per run)."""
    records: dict[tuple[str, str], RequestRecord] = {}
    for run_id, run in runs.items():
        names = [ref.request for ref in refs if ref.run == run_id]
        records.update(((run_id, r.request_id), r) for r in store.requests_to_read(run, names))
    seqs = []
    for i, ref in enumerate(refs):
        request = records[(ref.run, ref.request)]
        spec = layouts.sequence_spec(request.expected_rows, ref.start, ref.num_tokens,
                                     f"sequence {i} ({ref.run}/{ref.request})")
        seqs.append(StoredSequence(ref, runs[ref.run], request, spec))
    return seqs


def whole_sequences(store: RouteStore, seqs: list[StoredSequence]) -> dict[int, RouteRows]:
    """Every sequence's rows fed (`[start, start + rows)`), by its index: what every rank of the batch sees alike."""
    return {i: store.read_rows(s.run, s.request, s.spec.start, s.spec.start + s.spec.rows)
            for i, s in enumerate(seqs)}


def gather(store: RouteStore, seqs: list[StoredSequence], plan: layouts.TokenPlan, held: HeldLayers,
           missing: MissingPolicy, report_rows: int, labels: VersionLabels,
           whole: dict[int, RouteRows] | None = None) -> Gathered:
    """The plan's ids, masks and versions (`gather.gather_rows`, versions as indices into `labels`); StrictRefusal
    naming the first flagged or missing rows of real tokens under `missing=strict`.

    `whole`: sequences whose rows fed were read already (`whole_sequences`), sliced here instead of read again.
    """
    flagged: list[dict] = []
    strict = missing is MissingPolicy.STRICT
    specs = [s.spec for s in seqs]
    held_rows = whole or {}
    known = {}  # every sequence's spans, one index read per run (taken after the requests)
    for run_id in dict.fromkeys(s.run.run_id for s in seqs):
        of_run = [s for s in seqs if s.run.run_id == run_id]
        known[run_id] = store.spans_of_requests(of_run[0].run, [s.request for s in of_run])

    def read_rows(i: int, lo: int, hi: int) -> RowsRead:
        seq = seqs[i]
        ref, spec = seq.ref, seq.spec
        if i in held_rows:
            route, cut = held_rows[i], slice(lo, hi)
            ids: IdRows = DenseIds(route.experts[cut], route.shape)
            flags, positions, versions = route.flags[cut], route.positions[cut], route.versions().take(cut)
        else:  # located only: the rank's rows are copied from their segments once, by gather_rows
            found = store.locate_rows(seq.run, seq.request, spec.start + lo, spec.start + hi,
                                      known_spans=known[seq.run.run_id], keep=True)
            ids, flags, positions = found, found.flags, found.positions
            versions = WeightVersions.unknown(len(positions)) if found.versions is None else found.versions
        ok = flags == 0
        if strict and not ok.all() and len(flagged) < report_rows:
            for j in np.flatnonzero(~ok)[: report_rows - len(flagged)]:
                flagged.append({"run_id": ref.run, "request_id": ref.request, "position": int(positions[j]),
                                "flags": flag_names(int(flags[j]))})
        return RowsRead(ids, ok, labels.codes(versions))

    got = gather_rows(plan, specs, read_rows, held, missing)
    if strict and got.broken.size:
        bad = got.broken
        first = flagged[0]["position"] if flagged else int(specs[plan.sequence[bad[0]]].start + plan.offset[bad[0]])
        raise StrictRefusal(
            f"strict read refused: {bad.size} tokens of this rank have a flagged or missing row, the first at "
            f"position {first}; ask with missing=router to let the trainer's router choose those tokens' experts "
            "(its RouterReplay must then route -1 rows itself), or missing=filler to replay filler ids", flagged,
        )
    return got
