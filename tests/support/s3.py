"""A real S3 HTTP endpoint on loopback for tests: `moto` in server mode (no MinIO binary installs here).

The service talks to it as to any S3-compatible store: plain `pyarrow.fs.S3FileSystem` configured from the
usual AWS variables (`env`); nothing in the service knows it is moto.
"""

from __future__ import annotations

import uuid

import pyarrow.fs as pafs
from moto.server import ThreadedMotoServer

from tests.support.service import free_port

REGION = "us-east-1"


class MotoS3:
    """A moto S3 server on a free loopback port; `bucket()` makes a fresh bucket, `env()` what a service needs."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def aws_env(self) -> dict[str, str]:
        """Endpoint, region and (moto's any-value) credentials, as the usual AWS variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION,
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

    def fs(self) -> pafs.S3FileSystem:
        """A client of this server, for the test's own looks into the bucket."""
        return pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http", region=REGION,
                                 access_key="testing", secret_key="testing", allow_bucket_creation=True)

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given); its name."""
        name = name or f"replay-{uuid.uuid4().hex[:12]}"
        self.fs().create_dir(name)
        return name

    def env(self, bucket: str, prefix: str = "segments") -> dict[str, str]:
        """Environment of a service whose segments live under `s3://bucket/prefix` here."""
        return {**self.aws_env(), "REPLAY_SEGMENTS_URL": f"s3://{bucket}/{prefix}"}
