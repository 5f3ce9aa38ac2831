"""The routing-replay service: ingest, check, store and serve MoE routing (FastAPI; the `service` extra).

`__version__` is the installed distribution's version (pyproject.toml's, the one source): `replay-service
--version`, `/healthz` and the OpenAPI document say it.
"""

from importlib.metadata import version

__version__ = version("routing-replay")
