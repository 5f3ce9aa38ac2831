"""The formats every routing-replay process reads and writes (see README.md beside this file).

`replay_format.core` holds what they share; each message has one module (its builder and
its reader) and one spec file next to it.
"""

from replay_format.core import (
    ALL_FLAGS,
    ARROW_STREAM_MEDIA_TYPE,
    FLAG_MASK,
    ID_RULE,
    JSON_MEDIA_TYPE,
    NO_TOKEN,
    NPY_MEDIA_TYPE,
    WRITER_FLAGS,
    Flag,
    FormatError,
    FormatVersion,
    LayerAxis,
    ReplayDeprecationWarning,
    RunShape,
    Source,
    UndecodableError,
    check_id,
    expert_dtype,
    flag_names,
    parse_flag,
    valid_id,
)

__all__ = [
    "ALL_FLAGS", "ARROW_STREAM_MEDIA_TYPE", "FLAG_MASK", "ID_RULE", "JSON_MEDIA_TYPE", "NO_TOKEN", "NPY_MEDIA_TYPE",
    "WRITER_FLAGS", "Flag", "FormatError", "FormatVersion", "LayerAxis", "ReplayDeprecationWarning", "RunShape",
    "Source", "UndecodableError", "check_id", "expert_dtype", "flag_names", "parse_flag", "valid_id",
]
