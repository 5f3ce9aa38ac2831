"""Whole routes as engines hand them out (vLLM `.npy`, SGLang base64 JSON), decoded into row batches (`Rows`).

Contract: `engine_route_rows` turns an `EngineRoute` into rows at positions `start ..` under the writer
`upload_writer(request, start)` (a retry of a turn is idempotent), storing only the MoE layers (`choose_layers`: the
caller's list, else the run's, never guessed); `upload_versions` maps weight-version spans over output tokens onto
rows. A -1 is engines' padding (`padding_of`): a row of -1 is a PADDING row (not stored; counted), a trailing slot
of -1 on every row is dropped (a fused shared-expert slot), any other -1 is refused naming where it is. Errors are
`FormatError` (`UndecodableError` for a body that is not .npy or JSON), `InvalidInput` or `Conflict` (an array that
fits neither of the run's axes), naming the problem.
Design: docs/design/ingest.md ("Engine outputs", "Weight versions of an upload").
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

import numpy as np

from replay_format import NO_TOKEN, Flag, FormatError, RunShape, Source, UndecodableError
from replay_format.rows import POSITION_MAX, Rows, RowsMeta, narrow_ids
from replay_format.weight_versions import VersionSpan, WeightVersions, check_label, span_from_json, spans_to_rows
from replay_service.errors import Conflict, InvalidInput

ID_DTYPES = ("int32", "int64", "int16", "uint8", "uint16")  # what a JSON route's `dtype` (the older key) may name
# What SGLang's `meta_info["routed_experts_dtype"]` may name: `_WIRE_DTYPES` of sglang
# srt/state_capturer/routed_experts_wire.py (read stripped and lower-cased, as its `_wire_dtype` does).
SGLANG_WIRE_DTYPES = ("int32", "uint16", "uint8")


@dataclass
class EngineRoute:
    """A whole route (or one turn of it) from an engine output, before its layers are chosen."""

    route: np.ndarray  # (n, layers, K) integers: rows of positions start .. start+n-1
    num_experts: int | None
    moe_layers: tuple[int, ...] | None  # the caller's list of MoE layers (model-layer indices)
    token_ids: np.ndarray | None
    source: Source
    start: int | None = None  # first row's position (vLLM routed_experts_prompt_start, SGLang routed_experts_start_len)
    num_hidden_layers: int | None = None  # the caller's model layer count
    weight_versions: list[VersionSpan] | None = None  # spans over output tokens (vLLM's, SGLang's)
    weight_version: str | None = None  # one version for every row (SGLang's meta_info["weight_version"])
    prompt_tokens: int | None = None  # P; default: the tokens before the spans' output tokens


MAX_SPANS = 100_000  # weight-version spans one upload may carry (one per weight update during the request)


def parse_spans(value: object, what: str = "weight_versions") -> list[VersionSpan]:
    """A JSON list of spans (`{"version", "start", "end"}` objects or `[version, start, end]` triples)."""
    if not isinstance(value, list):
        raise InvalidInput(f"{what} must be a list of spans {{'version', 'start', 'end'}}, got {value!r:.200}")
    if len(value) > MAX_SPANS:
        raise InvalidInput(f"{what} holds {len(value)} spans; at most {MAX_SPANS}")
    return [span_from_json(v, what) for v in value]


def upload_versions(route: EngineRoute, start: int, n: int) -> WeightVersions | None:
    """The weight version of each of the rows `start .. start+n-1` (module docstring); None when none is given.

    FormatError (a bad label, an overlap, a row in no span) or InvalidInput (spans past the route) naming it.
    """
    if route.weight_version is not None and route.weight_versions is not None:
        raise InvalidInput("give weight_versions (spans) or weight_version (one for every row), not both")
    if route.weight_version is not None:
        return WeightVersions.single(check_label(route.weight_version, "weight_version"), n)
    spans = route.weight_versions
    if spans is None:
        return None
    if not spans:
        raise InvalidInput("weight_versions is empty: it must cover the route's output tokens")
    tokens = start + n + 1  # T: the route's rows are positions up to T-2
    outputs = max(s.end for s in spans)
    prompt = route.prompt_tokens if route.prompt_tokens is not None else tokens - outputs
    if not 1 <= prompt <= tokens - 1:
        raise InvalidInput(f"weight_versions cover {outputs} output tokens, but the route's rows "
                           f"{start}..{start + n - 1} are a sequence of {tokens} tokens: {prompt} prompt tokens "
                           "cannot be (give prompt_tokens, or spans over output tokens 0..T-P-1)")
    if outputs > tokens - prompt:
        raise InvalidInput(f"weight_versions reach output token {outputs - 1}, but a sequence of {tokens} tokens with "
                           f"{prompt} prompt tokens has {tokens - prompt} output tokens (0..{tokens - prompt - 1})")
    outputs_of_rows = np.maximum(np.arange(start, start + n, dtype=np.int64) - (prompt - 1), 0)
    try:
        return spans_to_rows(spans, outputs_of_rows, "weight_versions (over output tokens; output token j is the "
                                                     f"row at position {prompt - 1}+j)")
    except FormatError as exc:
        raise FormatError(f"{exc}; {n} rows from position {start}, {prompt} prompt tokens") from None


@dataclass(frozen=True)
class LayerChoice:
    """Which model layers an uploaded array's layers are."""

    moe_layers: tuple[int, ...]
    num_hidden_layers: int  # 0: not known (RunShape derives max(moe_layers) + 1)
    model_axis: bool  # the array holds every model layer (dense ones zero), else exactly the MoE layers


REFUSE_TO_GUESS = (
    "the service does not guess which layers are MoE layers: pass moe_layers (the model-layer indices of the "
    "layers with a router, e.g. 3..60 for DeepSeek-V3; `?moe_layers=` or the JSON field), and num_hidden_layers "
    "when the array holds only the MoE layers")


def choose_layers(route: np.ndarray, moe_layers: tuple[int, ...] | None, num_hidden_layers: int | None,
                  run_shape: RunShape | None) -> LayerChoice:
    """The layer list of an uploaded `(n, layers, K)` array, from the caller, else the run, else refused when ambiguous.

    An array of a run's `num_moe_layers` layers is on the MoE axis, one of `num_hidden_layers` on the
    model axis (vLLM's and SGLang's `routed_experts`). Without a list or a run, every layer is a MoE
    layer when none is all zero; a zero layer may be dense or a real top-1 layer that chose expert 0
    on every row, so that is refused (InvalidInput saying to pass `moe_layers`), never dropped.
    """
    if route.ndim != 3:
        raise InvalidInput(f"a route is (rows, layers, top_k); got shape {route.shape}")
    if 0 in route.shape:
        raise InvalidInput(f"a route of shape {route.shape} holds no ids: it needs at least one row, layer and "
                           "top-k slot (a request with a single token has no rows: send only its finish)")
    width = route.shape[1]
    if moe_layers:
        layers = tuple(moe_layers)
        if layers[0] < 0 or any(b <= a for a, b in zip(layers, layers[1:])):
            raise InvalidInput(f"moe_layers {list(layers)} must be increasing model-layer indices >= 0")
        if num_hidden_layers and width == num_hidden_layers and layers[-1] < width:
            return LayerChoice(layers, width, model_axis=True)
        if width == len(layers):
            return LayerChoice(layers, num_hidden_layers or 0, model_axis=False)
        if not num_hidden_layers and layers[-1] < width:
            return LayerChoice(layers, width, model_axis=True)
        model = (f"num_hidden_layers={num_hidden_layers}" if num_hidden_layers
                 else f"every layer of a model of more than {layers[-1]} layers")
        raise InvalidInput(
            f"the array holds {width} layers: neither the {len(layers)} of moe_layers {list(layers)} nor {model}")
    if run_shape is not None:
        return _layers_of_run(width, num_hidden_layers, run_shape)
    zero = np.flatnonzero(~route.reshape(route.shape[0], width, -1).any(axis=(0, 2)))
    if zero.size:
        raise InvalidInput(f"layers {zero.tolist()} of the array are all zero (dense layers, or MoE layers whose "
                           f"top-1 was expert 0 on every row): {REFUSE_TO_GUESS}")
    if num_hidden_layers and num_hidden_layers != width:
        raise InvalidInput(f"the array holds {width} layers of a {num_hidden_layers}-layer model: {REFUSE_TO_GUESS}")
    return LayerChoice(tuple(range(width)), width, model_axis=True)


def _layers_of_run(width: int, num_hidden_layers: int | None, run: RunShape) -> LayerChoice:
    hidden = num_hidden_layers or run.num_hidden_layers
    if width == run.num_moe_layers:
        return LayerChoice(run.moe_layers, num_hidden_layers or 0, model_axis=False)
    if width == hidden:
        return LayerChoice(run.moe_layers, width, model_axis=True)
    # A run that never learnt its model's layer count (max(moe_layers) + 1) learns it from a wider model-axis array.
    if not num_hidden_layers and run.num_hidden_layers == run.moe_layers[-1] + 1 and width > run.num_hidden_layers:
        return LayerChoice(run.moe_layers, width, model_axis=True)
    raise Conflict(
        f"the array holds {width} layers: neither the run's {run.num_moe_layers} MoE layers {list(run.moe_layers)} "
        f"nor its model's {run.num_hidden_layers} layers; send one of those (or pass moe_layers and "
        "num_hidden_layers if this is another model)")


def moe_rows(route: np.ndarray, choice: LayerChoice) -> np.ndarray:
    """The MoE layers of an array on `choice`'s axis, `(n, num_moe_layers, K)`; its dense layers must be zero.

    A non-zero id on a layer outside `moe_layers` means the list does not describe the array (an
    off-by-one list, another model): InvalidInput, never a silent shift of every layer.
    """
    if not choice.model_axis:
        return route
    layers = list(choice.moe_layers)
    if len(layers) == route.shape[1]:
        return route
    dense = np.setdiff1d(np.arange(route.shape[1]), layers)
    nonzero = dense[route[:, dense].reshape(route.shape[0], len(dense), -1).any(axis=(0, 2))]
    if nonzero.size:
        raise InvalidInput(f"layers {nonzero.tolist()} are not in moe_layers {layers} but hold non-zero ids: "
                           "the layer list does not describe this array")
    return np.ascontiguousarray(route[:, layers, :])


def load_json(body: bytes | memoryview) -> object:
    """A JSON body; UndecodableError when it is not JSON at all."""
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UndecodableError(f"body is not JSON: {exc}") from None
    except RecursionError:  # json.loads recurses once per nesting level: a deep body would reach the stack's end
        raise UndecodableError("body is JSON nested too deeply to decode") from None


def sglang_ids_dtype(doc: dict, where: str = "") -> np.dtype:
    """The dtype of `routed_experts`' bytes: `routed_experts_dtype` (SGLang's key: what was actually sent), or `dtype`
    (this service's older key, an alias), int32 when neither is given (SGLang's readers assume int32 then).

    InvalidInput naming the field for an unknown name, or two keys that disagree.
    """
    wire, alias = doc.get("routed_experts_dtype"), doc.get("dtype")
    named = None
    if wire is not None:
        name = wire.strip().lower() if isinstance(wire, str) else None
        if name not in SGLANG_WIRE_DTYPES:
            raise InvalidInput(f"'{where}routed_experts_dtype' {wire!r:.100} is not one SGLang sends "
                               f"({', '.join(SGLANG_WIRE_DTYPES)}; absent means int32)")
        named = np.dtype(name)
    if alias is not None:
        if alias not in ID_DTYPES:
            raise InvalidInput(f"'{where}dtype' {alias!r:.100} is not an integer id type ({', '.join(ID_DTYPES)}; "
                               "SGLang's own key is 'routed_experts_dtype')")
        if named is not None and np.dtype(alias) != named:
            raise InvalidInput(f"'{where}routed_experts_dtype' {wire!r} and '{where}dtype' {alias!r} disagree")
        named = np.dtype(alias)
    return named if named is not None else np.dtype(np.int32)


def sglang_ids(encoded: object, dtype: np.dtype, where: str = "") -> np.ndarray:
    """The flat ids of SGLang's base64 `routed_experts` (`pybase64.b64encode(array.astype(dtype).tobytes())`)."""
    if not isinstance(encoded, str):
        raise InvalidInput(f"'{where}routed_experts' must be a base64 string of {dtype} ids, "
                           f"got {type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"'{where}routed_experts' is not valid base64: {exc}") from None
    if len(raw) % dtype.itemsize:
        raise InvalidInput(f"'{where}routed_experts' decodes to {len(raw)} bytes, not a whole number of {dtype} ids "
                           f"({dtype.itemsize} bytes each; routed_experts_dtype says which)")
    return np.frombuffer(raw, dtype=dtype)


def decode_sglang_json(body: bytes | memoryview) -> EngineRoute:
    """SGLang-style `{"routed_experts": base64 ids, "num_layers", "top_k", ...}`.

    `routed_experts_dtype` (SGLang's meta_info key: uint8, uint16 or int32; `dtype` is an older alias) names the ids'
    type, int32 when absent. Optional: `num_experts`, `token_ids`, `moe_layers`, `num_hidden_layers`, and
    `routed_experts_start_len` (SGLang's request field: the response covers positions `[start, seqlen - 1)`).
    """
    doc = load_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("routed_experts"), str):
        raise InvalidInput("JSON route needs 'routed_experts': a base64 string of ids (int32 unless "
                           "'routed_experts_dtype' says uint8 or uint16)")
    ids = sglang_ids(doc["routed_experts"], sglang_ids_dtype(doc))
    # `num_layers` is SGLang's name: the layers of the flattened array (model layers or MoE layers).
    num_layers, top_k = _json_int(doc, "num_layers"), _json_int(doc, "top_k")
    if num_layers is None or top_k is None:
        raise InvalidInput("JSON route needs integer 'num_layers' and 'top_k' (the flattened array's shape)")
    if num_layers < 1 or top_k < 1 or ids.size % (num_layers * top_k):
        raise InvalidInput(f"{ids.size} ids do not split into rows of num_layers*top_k = {num_layers}*{top_k}")
    token_ids, moe_layers = _json_int_list(doc, "token_ids"), _json_int_list(doc, "moe_layers")
    start = _json_int(doc, "routed_experts_start_len")
    hidden = _json_int(doc, "num_hidden_layers")
    if (start is not None and start < 0) or (hidden is not None and hidden < 1):
        raise InvalidInput("'routed_experts_start_len' must be >= 0 and 'num_hidden_layers' >= 1")
    prompt = _json_int(doc, "prompt_tokens")
    if prompt is not None and prompt < 1:
        raise InvalidInput("'prompt_tokens' must be >= 1")
    spans = parse_spans(doc["weight_versions"]) if doc.get("weight_versions") is not None else None
    single = doc.get("weight_version")
    return EngineRoute(
        route=ids.reshape(-1, num_layers, top_k),
        num_experts=_json_int(doc, "num_experts"),
        moe_layers=tuple(moe_layers) if moe_layers else None,
        token_ids=np.asarray(token_ids, np.int64) if token_ids is not None else None,
        source=Source.SGLANG_OUTPUT,
        start=start,
        num_hidden_layers=hidden,
        weight_versions=spans,
        weight_version=None if single is None else check_label(single, "'weight_version'"),
        prompt_tokens=prompt,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_int(doc: dict, key: str) -> int | None:
    value = doc.get(key)
    if value is not None and not _is_int(value):
        raise InvalidInput(f"'{key}' must be an integer, got {value!r}")
    return value


def _json_int_list(doc: dict, key: str) -> list[int] | None:
    value = doc.get(key)
    if value is not None and not (isinstance(value, list) and all(_is_int(v) and abs(v) < 2**31 for v in value)):
        raise InvalidInput(f"'{key}' must be a list of integers")
    return value


def upload_writer(request_id: str, start: int) -> str:
    """The writer id of a whole-route upload starting at `start` (its seq is its row count).

    "upload/<request>@<start>" breaks the id rule on purpose: no real writer can send it. Each turn
    of a request (another start) is its own batch; the same turn again is a retry (idempotent).
    """
    return f"upload/{request_id}@{start}"


PADDING_ID = -1  # what engines write where there is no expert: vLLM's padded MoE rows, SGLang's fused slots, tunix


@dataclass(frozen=True)
class Padding:
    """Where an engine's array holds -1 as padding (`padding_of`)."""

    rows: np.ndarray  # bool (n,): rows of -1 alone
    slots: int  # trailing top-k slots of -1 on every other row and layer (a fused shared-expert slot)
    length: int  # rows up to the last that is not padding: the route's own length

    @property
    def trailing_rows(self) -> int:
        """Padding rows after the route's last row (an array padded to a fixed length)."""
        return len(self.rows) - self.length


def padding_of(route: np.ndarray) -> Padding:
    """The padding of an `(n, layers, K)` array of ids; InvalidInput naming the first -1 that is not padding.

    A row whose every id is -1 is a padding row, wherever it is; then a trailing slot that is -1 on every other row
    and layer is dropped as an engine-internal slot past `top_k`. Any other -1 (beside expert ids in a row) is no
    route at all.
    """
    if not np.issubdtype(route.dtype, np.signedinteger) or not route.size or route.min() >= 0:
        return Padding(np.zeros(len(route), bool), 0, len(route))
    minus = route == PADDING_ID
    rows = minus.all(axis=(1, 2))
    kept = minus[~rows]
    slots = 0
    while slots < route.shape[2] - 1 and kept.size and kept[:, :, route.shape[2] - 1 - slots].all():
        slots += 1
    rest = kept[:, :, :route.shape[2] - slots]
    if rest.any():
        row, layer, slot = (int(v) for v in np.argwhere(rest)[0])
        row = int(np.flatnonzero(~rows)[row])
        raise InvalidInput(
            f"row {row} holds -1 at layer {layer}, slot {slot} beside expert ids: -1 is padding only as a whole row "
            "(not stored, its position left a gap) or as a trailing top-k slot on every row (dropped); send the "
            "expert ids the engine used for that token, or that whole row as -1")
    real = np.flatnonzero(~rows)
    if not real.size:
        raise InvalidInput(f"every one of the {len(route)} rows is -1 (padding): there is no route to store")
    return Padding(rows, slots, int(real[-1]) + 1)


@dataclass(frozen=True)
class EngineRows:
    """An engine route's rows up to its last real one (padding rows among them flagged PADDING), and what its
    padding left out: rows after the last real one and trailing top-k slots."""

    rows: Rows
    rows_cut: int
    slots_cut: int


def engine_route_rows(run_id: str, request_id: str, route: EngineRoute, run_shape: RunShape | None,
                      num_experts: int | None) -> EngineRows:
    """Rows at positions `start .. start+n-1` for an upload; idempotent on (run, upload_writer(request, start), n).

    Padding (`padding_of`) is not stored: its rows among the route's are flagged PADDING (dropped at ingest,
    counted on the request), the rows after its last real row and its trailing slots are cut."""
    padding = padding_of(route.route)
    array = route.route[:padding.length, :, :route.route.shape[2] - padding.slots]
    inside = padding.rows[:padding.length]
    if inside.any():
        array = array.copy()
        array[inside] = 0  # their ids are never read: zero keeps the layer checks to the real rows
    choice = choose_layers(array, route.moe_layers, route.num_hidden_layers, run_shape)
    experts3 = moe_rows(array, choice)
    n, num_moe_layers, top_k = experts3.shape
    experts_n = num_experts or route.num_experts or (run_shape.num_experts if run_shape else None)
    if experts_n is None:
        raise InvalidInput("num_experts is unknown: pass it (query parameter or JSON field) for a new run")
    start = route.start or 0
    if start + n - 1 > POSITION_MAX:
        raise InvalidInput(f"rows from start={start} reach position {start + n - 1}, past {POSITION_MAX}")
    try:
        shape = RunShape(num_moe_layers, top_k, experts_n, choice.moe_layers, choice.num_hidden_layers)
    except FormatError as exc:
        raise InvalidInput(f"the route's shape: {exc}") from None
    experts = narrow_ids(experts3.reshape(n, num_moe_layers * top_k), experts_n, what="route")
    meta = RowsMeta(run_id=run_id, writer_id=upload_writer(request_id, start), seq=n, shape=shape,
                    source=route.source)
    rows = Rows(meta=meta, request_ids=[request_id], request_index=np.zeros(n, np.int32),
                positions=np.arange(start, start + n, dtype=np.int32),
                token_ids=_upload_tokens(route.token_ids, start, n), experts=experts,
                flags=np.where(inside, Flag.PADDING, 0).astype(np.uint16),
                weight_versions=upload_versions(route, start, n))
    return EngineRows(rows, padding.trailing_rows, padding.slots)


def _upload_tokens(token_ids: np.ndarray | None, start: int, n: int) -> np.ndarray:
    """Input tokens of rows `start .. start+n-1`: `token_ids` from `start` (n or n+1 of them), or the whole sequence.

    The whole sequence is `start + n + 1` tokens (T: e.g. SGLang's input_ids + output ids); the
    counts never collide (at start 0 both readings are the same).
    """
    if token_ids is None:
        return np.full(n, NO_TOKEN, np.int32)
    if len(token_ids) in (n, n + 1):
        return token_ids[:n].astype(np.int32)
    if len(token_ids) == start + n + 1:
        return token_ids[start : start + n].astype(np.int32)
    raise InvalidInput(
        f"token_ids has {len(token_ids)} entries; rows {start}..{start + n - 1} need the tokens from position {start} "
        f"({n} or {n + 1}) or the whole sequence ({start + n + 1})")
