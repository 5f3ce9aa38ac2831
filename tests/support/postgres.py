"""A throwaway PostgreSQL cluster for tests: Debian's binaries, `initdb` + `pg_ctl` on a free loopback port.

`scripts/env.sh test` installs the `postgresql` package where it is missing; the binaries are looked up
under /usr/lib/postgresql/*/bin (the newest). initdb refuses to run as root, so when the tests run as root
the cluster belongs to the unprivileged `nobody` user: its files lie in a fresh directory under /tmp that
`nobody` owns, and every server command runs through `runuser -u nobody --`. The server listens on
127.0.0.1 (and the addresses `listen` adds), trusts local connections (a throwaway cluster: no password)
and is stopped, its files deleted, when the test session ends. `Cluster.new_database()` makes a fresh
database and answers its URL; `stop()` / `start()` take the server away and bring it back on the same port
(the index lost mid-run).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from tests.support.service import free_port

UNPRIVILEGED = "nobody"
SUPERUSER = "replay"


def binaries() -> Path | None:
    """The newest PostgreSQL bin directory (Debian layout), or None when the package is not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


class Cluster:
    """One running PostgreSQL server, owned by an unprivileged user when the tests run as root."""

    def __init__(self, listen: Sequence[str] = (), trusted: Sequence[str] = ()) -> None:
        """`listen`: addresses to listen on beside 127.0.0.1; `trusted`: client networks (CIDR) let in, as loopback
        is, without a password (a replica in a network namespace reaching the server over a veth link)."""
        bin_dir = binaries()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): run "
                               "`bash scripts/env.sh test`, which installs Debian's postgresql package")
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="replay-pg-"))
        self.root.chmod(0o755)  # the unprivileged owner of the cluster must reach its data directory
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, UNPRIVILEGED)
        self.listen = ",".join(["127.0.0.1", *listen])
        self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--locale=C")
        if trusted:
            with open(self.data / "pg_hba.conf", "a") as hba:  # the file belongs to `nobody`; root may append
                hba.writelines(f"host all all {net} trust\n" for net in trusted)
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        """Start the server on its port (again, after `stop`: the same data, the same URL)."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o",
                  f"-p {self.port} -k {self.root} -c listen_addresses={self.listen} -c fsync=off "
                  "-c max_connections=200", "start")

    def stop(self) -> None:
        """Stop the server now (fast: open sessions are cut), keeping its data: the index lost mid-run."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", UNPRIVILEGED, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=self.root)
        if done.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}{log}")

    def url(self, database: str = "postgres") -> str:
        """A connection URL for `database` (TCP on loopback)."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self, prefix: str = "t") -> str:
        """Create a fresh, empty database; its URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        """Stop the server (fast: sessions are cut) and delete its files."""
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
            except RuntimeError:
                pass  # already gone; its files go anyway
        shutil.rmtree(self.root, ignore_errors=True)
