"""An engine's whole answer (many requests' routes in one body), decoded item by item before any is stored.

`ResponseItem` is one item of the answer decoded into an upload under the id its user holds; `item_errors` names
the item in every error of its decoding, so a refusal says which item and request could not be stored (the
answer's other items are not stored either: `uploads.store_items` checks all before storing any). The engines'
answers: `sglang_responses.py` (SGLang's `/generate`), `vllm_responses.py` (vLLM's OpenAI server and `LLM`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from replay_format import FormatError
from replay_service.errors import InvalidInput, ServiceError
from replay_service.ingest.decode import Upload


@dataclass
class ResponseItem:
    """One item of the answer, decoded: where it is stored and its rows."""

    index: int
    request_id: str
    upload: Upload


@contextmanager
def item_errors(what: str, index: int, request_id: object) -> Iterator[None]:
    """Re-raise a refusal of item `index` (`what`: "item", "choice", "output") prefixed with its index and id."""
    where = f"{what} {index} (request {request_id!r}): "
    try:
        yield
    except ServiceError as exc:
        raise type(exc)(where + exc.message) from None
    except FormatError as exc:
        raise type(exc)(where + str(exc)) from None


def same_shape(items: list[ResponseItem], upload: Upload) -> None:
    """InvalidInput when an item's run shape is not the first item's: one answer is one model."""
    if items and upload.rows.meta.shape != items[0].upload.rows.meta.shape:
        raise InvalidInput(f"its shape {upload.rows.meta.shape} is not the first's {items[0].upload.rows.meta.shape}: "
                           "one answer is one model")
