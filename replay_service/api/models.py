"""Request and response bodies of the JSON endpoints, as pydantic models (they are the `/docs` schemas).

Arrow and .npy answers are specified in replay_format (route.md, trainer_slice.md); the routers
document them with `responses=` media types. Every 4xx answer is an `ErrorBody`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from replay_format import ARROW_STREAM_MEDIA_TYPE, ID_RULE, JSON_MEDIA_TYPE, NPY_MEDIA_TYPE, LayerAxis, valid_id
from replay_format.weight_versions import LABEL_RULE, RecomputeRule
from replay_service.store.index import RequestStatus

FlagCounts = dict[str, int]  # flag name -> rows carrying it


# ---- errors -------------------------------------------------------------------------------------


class BadRow(BaseModel):
    """One flagged or missing row a strict read refused."""

    run_id: str | None = Field(None, description="trainer reads name the run of each row")
    request_id: str
    position: int
    flags: list[str]


class ErrorBody(BaseModel):
    """Every error answer: `detail` names the problem."""

    detail: str
    bad_rows: list[BadRow] | None = Field(None, description="strict reads (409): the first flagged or missing rows")
    errors: list[dict] | None = Field(None, description="request validation (422): pydantic's list of problems")


# Every JSON route declares these; a route adds its own codes (409, 413, 415) where it can answer them.
Responses = dict[int | str, dict[str, Any]]  # FastAPI's `responses=`

ERRORS: Responses = {
    400: {"model": ErrorBody, "description": "the body is not the container it claims (not Arrow, not .npy)"},
    404: {"model": ErrorBody, "description": "no such run, request or comparison"},
    422: {"model": ErrorBody, "description": "a parameter or body breaks a rule; `detail` names it"},
}
AUTH: Responses = {
    401: {"model": ErrorBody, "description": "no bearer token, or an unknown one (with REPLAY_TOKENS_FILE set)"},
    403: {"model": ErrorBody, "description": "the token lacks the role, the run is outside its prefix, or the "
                                              "request belongs to another writer"},
}
CONFLICT: Responses = {
    409: {"model": ErrorBody, "description": "contradicts what is stored, or a strict read met flagged rows"},
}
BODY_LIMITS: Responses = {
    413: {"model": ErrorBody, "description": "body over REPLAY_MAX_BODY_BYTES"},
    415: {"model": ErrorBody, "description": "body in a media type the endpoint does not take"},
    408: {"model": ErrorBody, "description": "body slower than REPLAY_BODY_MIN_BYTES_PER_S (after "
                                              "REPLAY_BODY_TIMEOUT_S); the connection is closed"},
}
STORAGE_FULL: Responses = {
    507: {"model": ErrorBody, "description": "the data directory's disk is full: nothing stored, retry later"},
}
LAYOUT_LIMITS: Responses = {
    413: {"model": ErrorBody, "description": "layout over REPLAY_MAX_LAYOUT_TOKENS, or a rank's slice over "
                                              "REPLAY_MAX_READ_ROWS; refused before anything is allocated"},
}


def binary_answer(*media_types: str, description: str) -> dict[str, Any]:
    """The `responses=` entry of an answer in these media types (Arrow, .npy: their specs give the layout)."""
    return {"description": description, "content": {m: {} for m in media_types}}


ARROW_ANSWER = (ARROW_STREAM_MEDIA_TYPE,)
ROUTE_MEDIA_TYPES = (ARROW_STREAM_MEDIA_TYPE, NPY_MEDIA_TYPE, JSON_MEDIA_TYPE)


# ---- weight versions ----------------------------------------------------------------------------


class WeightVersionSpan(BaseModel):
    """Positions `[start, end)` computed with the weights labelled `version` (the shape of vLLM's
    `WeightVersionSpan`, here over positions, not output tokens)."""

    version: str = Field(description=f"the weights' label: {LABEL_RULE}")
    start: int
    end: int = Field(description="exclusive")


class VersionRows(BaseModel):
    """A run's rows served (default rule) with one weight version."""

    version: str | None = Field(description="the label; null: rows whose version is not known (stored before "
                                            "versions existed, or by a writer that sends none)")
    rows: int


# ---- runs ---------------------------------------------------------------------------------------


class RunSummary(BaseModel):
    """One run: its shape, counts of requests and rows, rows per flag."""

    run_id: str
    num_moe_layers: int = Field(description="MoE layers per row")
    top_k: int
    num_experts: int
    moe_layers: list[int] = Field(description="model-layer index of each MoE layer, in row order")
    num_hidden_layers: int = Field(description="the model's layer count, dense layers included: the width of a "
                                               "`layer_axis=model` read; max(moe_layers) + 1 until a batch states it")
    dtype: str = Field(description="id dtype on the wire and on disk: uint8 or uint16")
    source: str | None = Field(None, description="who wrote the run's first batch (rows.md `source`)")
    created_at: float = Field(description="Unix time of the first batch")
    requests: int
    requests_ended: int = Field(description="requests finished or aborted")
    rows: int = Field(description="rows served, one per request and position (referenced_rows included)")
    referenced_rows: int = Field(0, description="of `rows`, those served through prefix-cache references: stored "
                                                "once, by the request that computed them, and not again")
    references: int = Field(0, description="distinct prefix-cache references received (POST .../references)")
    bytes: int = Field(description="bytes of segment files (references add none)")
    bytes_per_id: float | None = Field(None, description="`bytes` over the stored ids (rows less referenced_rows, "
                                       "x num_moe_layers x top_k): the other columns and the file framing included, "
                                       "so ~1.04 for uncompressed uint8 ids of 48 x top-8 (REPLAY_SEGMENT_COMPRESSION "
                                       "lowers it); null before any row")
    flagged: FlagCounts = Field(description="rows per flag (GAP: rows expected but never received)")
    weight_versions: list[VersionRows] = Field([], description="rows served by the default rule (`first`) per weight "
                                               "version, by label, then those of no known version (null) where any")
    recomputed: int = Field(0, description="positions recomputed under other weights (not CONFLICT), over its "
                                           "requests")
    pinned: bool = Field(False, description="retention never deletes a pinned run (PUT/DELETE .../pin)")
    last_write: float | None = Field(None, description="Unix time of the run's last stored batch (created_at when "
                                                       "none): retention's age of the run counts from it")


class RunDeleteAnswer(BaseModel):
    """What deleting a run freed."""

    run_id: str
    deleted: bool = True
    rows: int = Field(description="index rows deleted (runs, requests, spans, segments, flags, references, compares)")
    bytes: int = Field(description="bytes of files removed (segments, journal, comparison files)")
    files: int = Field(description="files removed")


class RunList(BaseModel):
    """Every run."""

    runs: list[RunSummary]


class ExpertLoad(BaseModel):
    """Tokens routed to each expert, per MoE layer, over the run's clean rows."""

    run_id: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    moe_layers: list[int]
    rows: int = Field(description="clean rows counted")
    counts: list[list[int]] = Field(description="[MoE ordinal][expert] tokens")
    imbalance: list[float] = Field(description="per MoE layer: max / mean tokens per expert")


# ---- requests -----------------------------------------------------------------------------------


class RequestSummary(BaseModel):
    """One request: status, rows, rows per flag."""

    request_id: str
    status: RequestStatus = Field(description="open, finished or aborted")
    num_tokens: int | None = Field(description="T, when finished or aborted (then T - 1 rows are expected)")
    rows: int = Field(description="rows served, one per position (referenced_rows included)")
    referenced_rows: int = Field(0, description="of `rows`, those served through prefix-cache references (rows "
                                                "another request stored at the same positions)")
    expected_rows: int = Field(description="T - 1 when ended, else the last position received or referenced + 1")
    first_flagged_position: int | None
    flagged: FlagCounts
    clean: bool = Field(description="no row flagged (PADDING aside) and none missing")
    weight_versions: list[WeightVersionSpan] = Field([], description="the weight versions of the rows served by the "
                                                     "default rule (`first`), as spans over positions; positions of "
                                                     "unknown version (or none stored) are in no span")
    recomputed: int = Field(0, description="positions computed again under other weights: both computations kept, "
                                           "not CONFLICT; `recompute=latest` reads serve the newer")
    first_recomputed: int | None = Field(None, description="the first of those positions; null when none")


class RequestPage(BaseModel):
    """One page of a run's requests, by request id."""

    items: list[RequestSummary]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last")


LAYER_AXIS_HELP = ("moe: the run's MoE layers (num_moe_layers per row); model: every model layer "
                   "(num_hidden_layers per row, dense layers zero), as vLLM's and SGLang's routed_experts")
RECOMPUTE_HELP = ("which computation of a position recomputed under other weights is served: first (default: the "
                  "rows the sampled tokens were produced with) or latest (the last one stored)")
WEIGHT_VERSION_HELP = "serve only rows of this weight version; other positions read as GAP"


POSITION_END_MAX = 2**31 - 1  # positions are int32 (0 .. 2^31 - 2, rows.md): an exclusive end is at most this


class RouteParams(BaseModel):
    """The query of `GET .../routes` (one model: validated in one call, not one per parameter)."""

    start: int = Field(0, ge=0, le=POSITION_END_MAX)
    end: int | None = Field(None, ge=0, le=POSITION_END_MAX,
                            description="exclusive; default: T-1 when finished, else last position + 1")
    strict: bool = Field(False, description="409 instead of data when any row in range is flagged or missing")
    format: str | None = Field(None, description="arrow | npy | json (overrides Accept)")
    layer_axis: LayerAxis = Field(LayerAxis.MOE, description=LAYER_AXIS_HELP)
    recompute: RecomputeRule = Field(RecomputeRule.FIRST, description=RECOMPUTE_HELP)
    weight_version: str | None = Field(None, description=WEIGHT_VERSION_HELP)


class RouteQuery(BaseModel):
    """Many routes of one run at once (`POST /v1/runs/{run}/routes/batch`)."""

    requests: list[str] = Field(min_length=1, description="request ids, answered in this order")
    start: int = Field(0, ge=0, le=POSITION_END_MAX)
    end: int | None = Field(None, ge=0, le=POSITION_END_MAX,
                            description="exclusive; default: each request to its own end")
    strict: bool = False
    layer_axis: LayerAxis = Field(LayerAxis.MOE, description=LAYER_AXIS_HELP)
    recompute: RecomputeRule = Field(RecomputeRule.FIRST, description=RECOMPUTE_HELP)
    weight_version: str | None = Field(None, description=WEIGHT_VERSION_HELP)


class RouteJsonRow(BaseModel):
    """One row of a route, for people."""

    position: int
    token_id: int | None = Field(description="null when unknown")
    experts: list[list[int]] = Field(description="[layer][k] expert ids; `layers` names each layer")
    flags: list[str]
    weight_version: str | None = Field(None, description="the weights that computed the row; null when unknown")


class RouteJson(BaseModel):
    """A route as JSON (`format=json`), for people and small ranges; programs read the Arrow answer (route.md)."""

    run_id: str
    request_id: str
    start: int
    end: int
    num_moe_layers: int
    top_k: int
    num_experts: int
    moe_layers: list[int]
    num_hidden_layers: int
    layer_axis: LayerAxis
    layers: list[int] = Field(description="model-layer index of each row's `experts` entry: moe_layers on the moe "
                                          "axis, 0..num_hidden_layers-1 on the model axis")
    flagged: FlagCounts = Field(description="rows per flag in this range")
    recompute: RecomputeRule = Field(RecomputeRule.FIRST, description="the rule the rows were served by")
    weight_version: str | None = Field(None, description="the weight version selected; null: every version")
    weight_versions: list[WeightVersionSpan] = Field([], description="the rows' versions as spans over positions")
    rows: list[RouteJsonRow]


# ---- prefix-cache references -------------------------------------------------------------------

MAX_REFERENCES = 10_000  # per body: a step's references are a few per scheduled request


# The references body of replay_format/request_notes.md (`references_body` writes it, under these field names);
# the bounds and error messages are this API's.
class PrefixReference(BaseModel):
    """Positions `[start, end)` of `request_id` hold the rows `source_request_id` stored at the same positions.

    vLLM served them from the prefix cache: KV blocks `source_request_id` computed (block hashes chain
    from position 0, so the positions are the same in both requests).
    """

    request_id: str = Field(description=f"the request reusing the blocks: {ID_RULE}")
    start: int = Field(ge=0, description="first position")
    end: int = Field(le=POSITION_END_MAX, description="one past the last position; greater than start")
    source_request_id: str = Field(description="the request that computed the blocks (not request_id)")

    @field_validator("request_id", "source_request_id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        if not valid_id(value):
            raise ValueError(f"{value!r} is not a valid id: {ID_RULE}")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> PrefixReference:
        if self.end <= self.start:
            raise ValueError(f"end={self.end} must be greater than start={self.start}")
        if self.request_id == self.source_request_id:
            raise ValueError(f"request {self.request_id!r} cannot reference itself")
        return self


class ReferenceBatch(BaseModel):
    """Prefix-cache references of one run (`POST /v1/runs/{run}/references`); idempotent per reference."""

    references: list[PrefixReference] = Field(max_length=MAX_REFERENCES,
                                              description=f"at most {MAX_REFERENCES} per body")


class ReferencesAnswer(BaseModel):
    """What one body of references did."""

    received: int = Field(description="references in the body")
    new: int = Field(description="references not received before (a retry or replayed spill adds none)")
    rows_resolved: int = Field(description="rows made readable by this call: the references' source rows already "
                                           "stored, in the referencing requests and in requests referencing them")


# ---- comparisons --------------------------------------------------------------------------------


class LayerAgreement(BaseModel):
    """Agreement at one MoE layer."""

    layer: int = Field(description="MoE ordinal")
    model_layer: int = Field(description="its model-layer index")
    router_mismatch: float
    jaccard: float


class WorstToken(BaseModel):
    """A token whose top-k sets differ at the most layers."""

    request_id: str
    position: int
    layers_differing: int
    jaccard: float = Field(description="mean over the token's MoE layers")


class CompareResult(BaseModel):
    """A stored comparison of a trainer's routing with the recorded one (R3's metrics)."""

    compare_id: str
    run_id: str
    label: str | None
    step: int | None = Field(None, description="the training step it was posted with (the agreement series)")
    weight_version: str | None = Field(None, description="the weight version it was posted with")
    created_at: float
    requests: int = Field(description="requests in the trainer's body")
    tokens: int = Field(description="tokens compared (with a clean recorded row)")
    router_mismatch: float = Field(description="fraction of (token, MoE layer) whose top-k sets differ")
    token_mismatch: float = Field(description="fraction of tokens with any MoE layer differing")
    jaccard: float = Field(description="mean |A & B| / |A | B| over (token, MoE layer)")
    missing_rows: int = Field(description="trainer rows without a clean recorded row: left out")
    per_layer: list[LayerAgreement]
    worst_layers: list[int] = Field(description="MoE ordinals, worst first")
    worst_tokens: list[WorstToken]


class CompareList(BaseModel):
    """A run's stored comparisons, newest first."""

    compares: list[CompareResult]


class CompareRequestDetail(BaseModel):
    """Per position and MoE layer: 1 where the trainer's top-k set differs from the recorded one."""

    request_id: str
    start: int
    end: int
    num_moe_layers: int
    positions: list[int] = Field(description="positions compared in [start, end)")
    mismatch: list[list[int]] = Field(description="[row][MoE ordinal] 0 or 1")


# ---- operations ---------------------------------------------------------------------------------


class Health(BaseModel):
    """Liveness, where the store is, and which release answers."""

    status: str
    runs: int
    data_dir: str
    version: str = Field(description="the routing-replay release serving (its distribution version)")
    pid: int = Field(description="the process that answered: under several workers (REPLAY_WORKERS), which one")
