"""vLLM's answers with their routed experts, as returned (spec: vllm_response.md).

Three bodies carry them, told apart by their `object` field (`ResponseObject`): the OpenAI server's completions
response (`"text_completion"`, one `routed_experts` per choice), its chat response (`"chat.completion"`), and the
offline `LLM.generate`'s `RequestOutput`, a Python object that `request_output_json` writes in the same terms
(`"vllm.request_output"`, this project's body). `routed_experts` is vLLM's `numpy2base64` of an array
`(rows, num_hidden_layers, top_k)` over positions `[routed_experts_prompt_start, T - 1)`; `decode_routed_experts` and
`read_npy` read it without pickles, checking the header against the length before anything is allocated. Which
stored id each choice is: `replay_format.vllm_ids`.
"""

from __future__ import annotations

import base64
import binascii
import enum
import io
from typing import Any

import numpy as np

from replay_format.core import FormatError, UndecodableError
from replay_format.vllm_ids import Endpoint
from replay_format.weight_versions import span_json


class ResponseObject(enum.StrEnum):
    """A vLLM answer's `object` field: which of the three bodies it is."""

    COMPLETION = "text_completion"  # POST /v1/completions
    CHAT = "chat.completion"  # POST /v1/chat/completions
    REQUEST_OUTPUT = "vllm.request_output"  # the offline RequestOutput (`request_output_json`)

    @property
    def endpoint(self) -> Endpoint:
        """Where such an answer comes from (the id rules of `replay_format.vllm_ids`)."""
        return {ResponseObject.COMPLETION: Endpoint.COMPLETIONS, ResponseObject.CHAT: Endpoint.CHAT,
                ResponseObject.REQUEST_OUTPUT: Endpoint.OFFLINE}[self]


def encode_routed_experts(array: np.ndarray) -> str:
    """vLLM's encoding of one choice's `routed_experts` (`numpy2base64`): base64 of the array's `.npy` bytes."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def read_npy(body: bytes | memoryview) -> np.ndarray:
    """A `.npy` body as an integer array viewing the body (no copy, no pickles).

    The header is checked against the body's length before anything is allocated, and a damaged header is an
    UndecodableError (numpy raises several kinds of error while parsing one); an array of another kind than
    integers is a FormatError.
    """
    fp = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except Exception as exc:  # noqa: BLE001 - ValueError, SyntaxError, TokenError, ... all mean "bad header"
        raise UndecodableError(f"body is not a .npy array: {exc}") from None
    if dtype.hasobject or not np.issubdtype(dtype, np.integer):
        raise FormatError(f".npy route must hold integer ids, got {dtype}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    data_bytes = len(body) - fp.tell()
    if count * dtype.itemsize != data_bytes:
        raise UndecodableError(
            f".npy header says {shape} of {dtype} ({count * dtype.itemsize} bytes) but the body holds {data_bytes}")
    array = np.frombuffer(body, dtype=dtype, count=count, offset=fp.tell())
    return array.reshape(shape, order="F" if fortran_order else "C")


def decode_routed_experts(encoded: object, where: str) -> np.ndarray:
    """One choice's `routed_experts` as its `(rows, layers, top_k)` array; FormatError naming `where` otherwise."""
    if not isinstance(encoded, str):
        raise FormatError(f"{where}routed_experts must be vLLM's base64 .npy string, got {type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FormatError(f"{where}routed_experts is not base64: {exc}") from None
    try:
        array = read_npy(raw)
    except FormatError as exc:
        raise FormatError(f"{where}routed_experts: {exc}") from None
    if array.ndim != 3:
        raise FormatError(f"{where}routed_experts holds an array of shape {array.shape}, not (rows, layers, top_k)")
    return array


def request_output_json(output: Any) -> dict[str, Any]:
    """An offline `RequestOutput` (vllm/outputs.py) as the `"vllm.request_output"` body (vllm_response.md).

    Each `CompletionOutput` gives its `index`, `token_ids`, `routed_experts` (encoded as the server does) and
    `weight_versions` (spans over output tokens, `WeightVersionSpan`s or dicts), as vLLM hands them out.
    """
    outputs = []
    for out in output.outputs:
        routed = getattr(out, "routed_experts", None)
        spans = getattr(out, "weight_versions", None)
        outputs.append({
            "index": int(out.index),
            "token_ids": [int(t) for t in out.token_ids],
            "routed_experts": None if routed is None else encode_routed_experts(np.asarray(routed)),
            "weight_versions": None if spans is None else [span_json(s) for s in spans],
        })
    prompt = getattr(output, "prompt_token_ids", None)
    return {"object": ResponseObject.REQUEST_OUTPUT.value, "request_id": str(output.request_id),
            "prompt_token_ids": None if prompt is None else [int(t) for t in prompt], "outputs": outputs}
