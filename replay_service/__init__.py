"""The routing-replay service: ingest, check, store and serve MoE routing (FastAPI; the `service` extra).

`__version__` is the installed distribution's version (pyproject.toml's, the one source): `replay-service
--version`, `/healthz` and the OpenAPI document say it. A checkout run from PYTHONPATH without installing (the lent
device machine's bench) says "0+unknown".
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("routing-replay")
except PackageNotFoundError:
    __version__ = "0+unknown"
