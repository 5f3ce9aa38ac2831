"""Helpers for format tests: rewrite a message's metadata to play an older or newer writer."""

from __future__ import annotations

import pyarrow as pa


def with_metadata(body: bytes | bytearray, patch: dict[str, str | None]) -> bytearray:
    """The Arrow IPC stream `body` with its schema metadata patched (a value of None removes the key)."""
    table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    md = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    for key, value in patch.items():
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    table = table.replace_schema_metadata(md)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytearray(sink.getvalue().to_pybytes())
