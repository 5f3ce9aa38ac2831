"""The one-route read paths (issue 14): every way of reading a route gives the bytes sent, through a real server.

The client reads GET answers into one buffer over its own connection (`Transport.fetch_bulk`),
or through a caller-supplied httpx client; `.npy` answers become views of that buffer; the
service sends an Arrow answer's small framing parts joined (`encode.joined_small`), its ids uncopied.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pyarrow as pa
import pytest

from replay_client import ReplayClient
from replay_client.client import npy_view
from replay_service.api.encode import SMALL_PART, joined_small
from tests.support.data import batch_bytes, routes
from tests.support.service import calls


@pytest.fixture(scope="module")
def stored(shared_service):
    """Run 'readpaths': two requests in one batch (one segment), one with a gap, both finished."""
    rng = np.random.default_rng(14)
    full = {"a": routes(rng, 700), "b": routes(rng, 90)}
    client = ReplayClient(shared_service.url)
    ids, pos, ex = [], [], []
    for rid, rows in full.items():
        keep = np.arange(len(rows)) if rid == "a" else np.delete(np.arange(len(rows)), [5, 6])
        ids += [rid] * len(keep)
        pos.append(keep)
        ex.append(rows[keep])
    client.ingest(batch_bytes("readpaths", "w", 0, ids, np.concatenate(pos), np.concatenate(ex)))
    for rid, rows in full.items():
        client.finish("readpaths", rid, len(rows) + 1)
    yield client, full
    client.close()


def test_every_get_path_is_byte_equal(stored, shared_service):
    client, full = stored
    expected = full["a"]
    own = ReplayClient(shared_service.url, http=httpx.Client(base_url=shared_service.url))  # the httpx fallback
    url = f"{shared_service.url}/v1/runs/readpaths/requests/a/routes"
    got = {
        "get_route": client.get_route("readpaths", "a").experts,
        "get_route_npy": client.get_route_npy("readpaths", "a"),
        "get_route, caller's httpx": own.get_route("readpaths", "a").experts,
        "get_route_npy, caller's httpx": own.get_route_npy("readpaths", "a"),
        "plain httpx .npy": np.load(io.BytesIO(calls.get(url, params={"format": "npy"}).content)),
        "plain httpx Arrow": pa.ipc.open_stream(calls.get(url).content).read_all()
        .column("experts").combine_chunks().flatten().to_numpy().reshape(expected.shape),
        "a range": np.concatenate([client.get_route_npy("readpaths", "a", end=300),
                                   client.get_route("readpaths", "a", start=300).experts]),
    }
    own.close()
    for name, array in got.items():
        assert array.shape == expected.shape and array.tobytes() == expected.tobytes(), name


def test_npy_answer_is_a_writable_view_of_one_buffer(stored):
    client, full = stored
    array = client.get_route_npy("readpaths", "b")
    assert array.flags.writeable and not array.flags.owndata  # a view of the received body, no copy
    expected = full["b"].copy()
    expected[[5, 6]] = 0  # GAP rows: ids zero
    assert array.tobytes() == expected.tobytes()
    array[0, 0, 0] = 7  # writable: torch.from_numpy needs no copy


def test_npy_view_reads_what_numpy_writes():
    for array in (np.arange(24, dtype=np.uint16).reshape(2, 3, 4), np.zeros((0, 5, 2), np.uint8),
                  np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))):
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        got = npy_view(bytearray(buf.getvalue()))
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)


def test_missing_route_is_a_404_on_the_bulk_path(stored):
    client, _ = stored
    from replay_client import NotFoundError

    with pytest.raises(NotFoundError):
        client.get_route("readpaths", "nope")
    with pytest.raises(NotFoundError):
        client.get_route_npy("readpaths", "nope")


def test_joined_small_keeps_bytes_and_large_views():
    big = memoryview(bytearray(SMALL_PART * 2))
    parts = [memoryview(b"ab"), memoryview(b"cd"), big, memoryview(b"ef")]
    out = joined_small(parts)
    assert b"".join(bytes(p) for p in out) == b"".join(bytes(p) for p in parts)
    assert len(out) == 3 and out[1] is big  # the large part goes out as it is: no copy of the ids
    assert joined_small([]) == []
