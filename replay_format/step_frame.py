"""Step frames: the pipe between an inference worker and its sink process (spec: step_frame.md).

The vLLM plugin's worker or engine core (`capture.vllm.sink.handoff`) writes them, its sink process
(`capture.vllm.sink.process`) reads them. One builder, `pack(frame)`; one reader,
`FrameReader.read(body)` (it learns the run shape from the configuration frame, the
stream's typed metadata `ConfigFrame`, and refuses an unknown major version there).
Frame kinds are `FrameKind`; a step is one `StepFrame` from the worker's step close to the
sink's `StepBook`. Steps are packed by hand (no pickle): pickling a step's arrays cost the
forward thread ~40 us per step inside the engine (bench/vllm_overhead.py); control frames
(configuration, finish, references, close) are JSON or a fixed struct.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from replay_format.core import FormatError, FormatVersion, RunShape
from replay_format.request_notes import FinishStatus, Reference
from replay_format.weight_versions import check_label

FORMAT = "routing-replay.step-frame"
# 1.1: the shape carries num_hidden_layers; 1.2: reference frames; 1.3: a step's weight version;
# 1.4: a request may end here to be decoded on another engine (`Ended.remote_decode`)
VERSION = FormatVersion(1, 4)

LENGTH = struct.Struct("<Q")  # every frame: u64 body length, then the body
_STEP = struct.Struct("<IIB")  # rows, requests, bits
_HAS_SPEC = 1  # bits: the step carries spec-decode counts
_HAS_VERSION = 2  # bits: the step carries its weight version (1.3)
_VERSION_LENGTH = struct.Struct("<B")  # the weight version's byte length (labels are at most 128 ASCII characters)
_CLOSE = struct.Struct("<d")
NO_SAMPLE = -1  # StepFrame.sampled: the sampler reported no count for that request


class FrameKind(enum.Enum):
    """The first byte of a frame body."""

    CONFIG = b"C"
    STEP = b"S"
    FINISH = b"F"
    REFERENCES = b"R"
    CLOSE = b"X"


@dataclass(frozen=True)
class ConfigFrame:
    """The stream's first frame: its version, the run shape steps are packed in, the sender's settings.

    `sender` is `capture.sender.SenderConfig.to_dict()` (that class validates it on the
    sink side); this format only requires it to be a JSON object.
    """

    shape: RunShape
    sender: dict[str, Any]
    version: FormatVersion = VERSION

    def to_metadata(self) -> dict[str, Any]:
        """The JSON object the frame carries (always the current version)."""
        shape = self.shape
        return {
            "format": FORMAT,
            "format_version": str(VERSION),
            "shape": {"num_moe_layers": shape.num_moe_layers, "top_k": shape.top_k, "num_experts": shape.num_experts,
                      "moe_layers": list(shape.moe_layers), "num_hidden_layers": shape.num_hidden_layers},
            "sender": self.sender,
        }

    @classmethod
    def from_metadata(cls, md: Any) -> ConfigFrame:
        """Parse and check a decoded configuration object; FormatError naming what is wrong."""
        what = "step-frame configuration"
        if not isinstance(md, dict):
            raise FormatError(f"{what}: not a JSON object")
        if md.get("format") != FORMAT:
            raise FormatError(f"{what}: format {md.get('format')!r}, expected {FORMAT!r}")
        version = FormatVersion.parse(str(md.get("format_version", "")), what).check(what, VERSION)
        shape, sender = md.get("shape"), md.get("sender")
        if not isinstance(shape, dict) or not isinstance(sender, dict):
            raise FormatError(f"{what}: 'shape' and 'sender' must be JSON objects")
        try:
            run_shape = RunShape(int(shape["num_moe_layers"]), int(shape["top_k"]), int(shape["num_experts"]),
                                 tuple(int(x) for x in shape.get("moe_layers", ())),
                                 int(shape.get("num_hidden_layers", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{what}: bad shape {shape!r}: {exc}") from None
        return cls(run_shape, sender, version)


@dataclass
class StepFrame:
    """One captured step as the model ran it: built once at the worker's step close, consumed by the sink.

    Rows are the step's tokens in batch order; request i owns rows
    `query_start_loc[i]:query_start_loc[i + 1]`. The arrays a reader returns view the frame
    body (read-only); they are the receiver's to keep. `weight_version` is the engine's label for the
    weights every row of the step was computed with (`replay_format.weight_versions`), None when unknown.
    """

    req_ids: list[str]  # the engine's (internal) request ids, batch order
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    positions: np.ndarray  # int32 [n]
    token_ids: np.ndarray  # int32 [n], NO_TOKEN where unknown
    experts: np.ndarray  # [n, L, K] in the run's expert dtype
    flags: np.ndarray  # uint16 [n] (the recorder's STALE)
    drafts: np.ndarray | None = None  # uint32 [num_reqs]: spec-decode drafts verified this step (None: no spec decode)
    sampled: np.ndarray | None = None  # int32 [num_reqs]: tokens sampled this step, NO_SAMPLE when unknown
    weight_version: str | None = None  # the weights the step ran with (None: unknown, e.g. a 1.2 writer)

    def __post_init__(self) -> None:
        if (self.drafts is None) != (self.sampled is None):
            raise ValueError("a step carries both spec-decode arrays (drafts, sampled) or neither")

    @property
    def num_tokens(self) -> int:
        """Rows of the step."""
        return len(self.positions)


class Ended(NamedTuple):
    """One request that ended here: the engine's id, its token count and status when the engine knows them.

    `remote_decode`: the request only ended on this engine: a prefill engine passed its KV on to a decode engine,
    which writes the rest of the route and its finish (prefill/decode disaggregation, vLLM's `do_remote_decode`);
    no finish is sent for it here.
    """

    request_id: str
    num_tokens: int | None = None
    status: FinishStatus | None = None
    remote_decode: bool = False


@dataclass(frozen=True)
class FinishFrame:
    """Requests that ended since the last frame, sent after every step frame holding their rows."""

    ended: list[Ended]


@dataclass(frozen=True)
class ReferencesFrame:
    """Prefix-cache hits of requests the step scheduled, sent before that step's frame (engine ids)."""

    references: list[Reference]


@dataclass(frozen=True)
class CloseFrame:
    """The worker is done: send what is queued within `timeout_s`, then spill the rest and exit."""

    timeout_s: float


Frame = ConfigFrame | StepFrame | FinishFrame | ReferencesFrame | CloseFrame


def _framed(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


def _pack_step(frame: StepFrame) -> bytes:
    names = [r.encode() for r in frame.req_ids]
    spec = frame.drafts is not None
    version = frame.weight_version
    bits = (_HAS_SPEC if spec else 0) | (0 if version is None else _HAS_VERSION)
    parts = [
        FrameKind.STEP.value, _STEP.pack(len(frame.positions), len(names), bits),
        np.asarray(frame.query_start_loc, np.int32).tobytes(), np.asarray(frame.positions, np.int32).tobytes(),
        np.asarray(frame.token_ids, np.int32).tobytes(), frame.experts.tobytes(),
        np.asarray(frame.flags, np.uint16).tobytes(),
    ]
    if spec:
        parts += [np.asarray(frame.drafts, np.uint32).tobytes(), np.asarray(frame.sampled, np.int32).tobytes()]
    parts += [np.array([len(b) for b in names], np.uint32).tobytes(), *names]
    if version is not None:
        parts.append(version_trailer(version))
    return _framed(b"".join(parts))


def version_trailer(label: str) -> bytes:
    """A step's weight-version field (`u8` length, then the label; step_frame.md); FormatError for a bad label."""
    encoded = check_label(label, "step frame weight version").encode()
    return _VERSION_LENGTH.pack(len(encoded)) + encoded


def pack(frame: Frame) -> bytes:
    """One frame, length prefix included (the one builder; step_frame.md has each layout)."""
    if isinstance(frame, StepFrame):  # first: the one sent every step
        return _pack_step(frame)
    if isinstance(frame, FinishFrame):
        ended = [{"request_id": e.request_id, "num_tokens": e.num_tokens,
                  "status": None if e.status is None else FinishStatus(e.status).value,
                  **({"remote_decode": True} if e.remote_decode else {})} for e in frame.ended]
        return _framed(FrameKind.FINISH.value + json.dumps(ended).encode())
    if isinstance(frame, ReferencesFrame):
        hits = [[r.request_id, r.start, r.end, r.source_request_id] for r in frame.references]
        return _framed(FrameKind.REFERENCES.value + json.dumps(hits).encode())
    if isinstance(frame, CloseFrame):
        return _framed(FrameKind.CLOSE.value + _CLOSE.pack(frame.timeout_s))
    if isinstance(frame, ConfigFrame):
        return _framed(FrameKind.CONFIG.value + json.dumps(frame.to_metadata()).encode())
    raise TypeError(f"not a frame: {type(frame).__name__}")


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body[1:])
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{what} frame is not JSON: {exc}") from None


def _read_ended(items: Any) -> list[Ended]:
    if not isinstance(items, list):
        raise FormatError("finish frame: not a JSON list")
    ended = []
    for item in items:
        try:
            request_id, num_tokens, status = item["request_id"], item.get("num_tokens"), item.get("status")
            remote_decode = item.get("remote_decode", False)
            if not isinstance(request_id, str) or not (num_tokens is None or type(num_tokens) is int) \
                    or type(remote_decode) is not bool:
                raise TypeError(item)
            ended.append(Ended(request_id, num_tokens, None if status is None else FinishStatus(status), remote_decode))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise FormatError(f"finish frame: bad entry {item!r}") from None
    return ended


def _read_references(items: Any) -> list[Reference]:
    if not isinstance(items, list):
        raise FormatError("references frame: not a JSON list")
    references = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and isinstance(item[3], str)
                and type(item[1]) is int and type(item[2]) is int and 0 <= item[1] < item[2]):
            raise FormatError(f"references frame: bad entry {item!r}")
        references.append(Reference(*item))
    return references


def _read_step(body: bytes, shape: RunShape) -> StepFrame:
    n, num_reqs, bits = _STEP.unpack_from(body, 1)
    at = 1 + _STEP.size

    def take(dtype, count: int) -> np.ndarray:
        nonlocal at
        array = np.frombuffer(body, dtype, count, at)
        at += array.nbytes
        return array

    qsl = take(np.int32, num_reqs + 1)
    positions = take(np.int32, n)
    token_ids = take(np.int32, n)
    experts = take(shape.dtype, n * shape.row_width).reshape(n, shape.num_moe_layers, shape.top_k)
    flags = take(np.uint16, n)
    drafts = sampled = None
    if bits & _HAS_SPEC:
        drafts, sampled = take(np.uint32, num_reqs), take(np.int32, num_reqs)
    lengths = take(np.uint32, num_reqs).tolist()
    req_ids = []
    for size in lengths:
        req_ids.append(body[at : at + size].decode())
        at += size
    version = None
    if bits & _HAS_VERSION:
        (size,) = _VERSION_LENGTH.unpack_from(body, at)
        at += _VERSION_LENGTH.size
        if at + size > len(body):
            raise ValueError(f"weight version of {size} bytes past the end of the frame")
        version = check_label(body[at : at + size].decode(), "step frame weight version")
        at += size
    if at != len(body) or int(qsl[-1]) != n:
        raise ValueError(f"{len(body) - at} bytes left over, or query_start_loc ends at {int(qsl[-1])} for {n} rows")
    return StepFrame(req_ids, qsl, positions, token_ids, experts, flags, drafts, sampled, version)


class FrameReader:
    """Reads one stream's frame bodies in order (the one reader).

    The configuration frame comes first: it carries the version (an unknown major is a
    FormatError saying so) and the run shape the step frames are packed in.
    """

    def __init__(self) -> None:
        self.config: ConfigFrame | None = None

    def read(self, body: bytes) -> Frame:
        """The frame in one body (without its length prefix); FormatError naming what is wrong."""
        try:
            kind = FrameKind(body[:1])
        except ValueError:
            raise FormatError(f"unknown frame kind {body[:1]!r}") from None
        if kind == FrameKind.CONFIG:
            if self.config is not None:
                raise FormatError("a second configuration frame")
            self.config = ConfigFrame.from_metadata(_json(body, "configuration"))
            return self.config
        if self.config is None:
            raise FormatError(f"a {kind.name.lower()} frame before the configuration frame")
        if kind == FrameKind.STEP:
            try:
                return _read_step(body, self.config.shape)
            except (ValueError, UnicodeDecodeError, struct.error) as exc:
                raise FormatError(f"step frame of {len(body)} bytes does not follow step_frame.md: {exc}") from None
        if kind == FrameKind.FINISH:
            return FinishFrame(_read_ended(_json(body, "finish")))
        if kind == FrameKind.REFERENCES:
            return ReferencesFrame(_read_references(_json(body, "references")))
        if len(body) != 1 + _CLOSE.size:
            raise FormatError(f"close frame of {len(body)} bytes, expected {1 + _CLOSE.size}")
        return CloseFrame(_CLOSE.unpack_from(body, 1)[0])
