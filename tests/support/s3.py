"""A real S3 HTTP endpoint on loopback for tests: `moto` in server mode (no MinIO binary installs here).

The service talks to it as to any S3-compatible store: plain `pyarrow.fs.S3FileSystem` configured from the
usual AWS variables (`env`); nothing in the service knows it is moto.

The server is its own process (`python -m moto.server`), not a thread of the test: stopping it closes its
listening socket and every kept-alive connection with it, as a store that went away does (moto's in-process
ThreadedMotoServer keeps both open after `stop()`: clients would hang, not fail), and it takes no GIL from
the test process.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import pyarrow.fs as pafs

from tests.support.service import free_port

from .service import calls

REGION = "us-east-1"


class MotoS3:
    """A moto S3 server on a free loopback port; `bucket()` makes a fresh bucket, `env()` what a service needs."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        """`host`: the address to listen on (another local address than loopback: a replica in a network
        namespace reaches the server over a veth link; every client then uses that address)."""
        self.host = host
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> MotoS3:
        """Start the server (an empty store: moto keeps nothing across starts) and wait until it answers."""
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                calls.get(f"{self.endpoint}/moto-api/", timeout=1.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer in {timeout}s")

    def stop(self) -> None:
        """Stop the server: its port refuses connections afterwards (and its buckets are gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def aws_env(self) -> dict[str, str]:
        """Endpoint, region and (moto's any-value) credentials, as the usual AWS variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION,
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

    def fs(self) -> pafs.S3FileSystem:
        """A client of this server, for the test's own looks into the bucket."""
        return pafs.S3FileSystem(endpoint_override=f"{self.host}:{self.port}", scheme="http", region=REGION,
                                 access_key="testing", secret_key="testing", allow_bucket_creation=True)

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given); its name."""
        name = name or f"replay-{uuid.uuid4().hex[:12]}"
        self.fs().create_dir(name)
        return name

    def env(self, bucket: str, prefix: str = "segments") -> dict[str, str]:
        """Environment of a service whose segments live under `s3://bucket/prefix` here."""
        return {**self.aws_env(), "REPLAY_SEGMENTS_URL": f"s3://{bucket}/{prefix}"}
