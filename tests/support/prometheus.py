"""A real Prometheus server for tests: Debian's `prometheus` (2.42) on a free loopback port, and its `promtool`.

`scripts/env.sh test` installs the package where it is missing (/usr/bin/prometheus, /usr/bin/promtool; the
package's own service is not used: policy-rc.d keeps it stopped in containers, and this server is ours). A
`PrometheusServer` writes a config scraping the given targets, starts the binary with a fresh TSDB in a temp
directory, waits for `/-/ready`, and answers queries and alerts from Prometheus' own HTTP API (`/api/v1/...`).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import yaml

from tests.support.service import free_port

from .service import calls

DEBIAN_BIN = Path("/usr/bin")


def binary(name: str) -> Path | None:
    """`prometheus` or `promtool`: Debian's, else one on PATH; None when neither is installed."""
    debian = DEBIAN_BIN / name
    if debian.exists():
        return debian
    found = shutil.which(name)
    return Path(found) if found else None


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `promtool ARGS` and answer the finished process (output captured as text)."""
    tool = binary("promtool")
    if tool is None:
        raise RuntimeError("promtool is not installed: run `bash scripts/env.sh test` (Debian's prometheus package)")
    return subprocess.run([str(tool), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


class PrometheusServer:
    """One Prometheus process scraping `targets` (host:port) every `scrape_interval_s`, with `rule_files` loaded."""

    def __init__(self, targets: Sequence[str], rule_files: Sequence[Path] = (), job: str = "routing-replay",
                 scrape_interval_s: float = 1.0, evaluation_interval_s: float = 1.0) -> None:
        """Nothing starts here (`start`); the config and the TSDB go into a fresh temp directory."""
        self.root = Path(tempfile.mkdtemp(prefix="replay-prom-"))
        self.port = free_port()
        self.log_path = self.root / "prometheus.log"
        interval = f"{int(scrape_interval_s * 1000)}ms"
        self.config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": f"{int(evaluation_interval_s * 1000)}ms"},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                                "static_configs": [{"targets": list(targets)}]}],
        }
        self.config_path = self.root / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its HTTP API's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        """Start the server and wait until it answers ready (its rules loaded); RuntimeError with its log if not."""
        exe = binary("prometheus")
        if exe is None:
            raise RuntimeError("prometheus is not installed: run `bash scripts/env.sh test` (Debian's package)")
        cmd = [str(exe), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.root / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
               # no console templates here (Debian puts them under /etc/prometheus): the API is all we read
               f"--web.console.templates={self.root}", f"--web.console.libraries={self.root}"]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; log: {self.log()}")
            try:
                if calls.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus did not become ready in {timeout}s; log: {self.log()}")

    def log(self) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def api(self, path: str, **params: str) -> object:
        """`GET /api/v1/<path>`'s `data` (an error status raises, naming Prometheus' error)."""
        answer = calls.get(f"{self.url}/api/v1/{path}", params=params, timeout=10.0).json()
        if answer.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path}: {answer}")
        return answer["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query's vector: `[{"metric": {labels}, "value": [t, "v"]}, ...]`."""
        data = self.api("query", query=promql)
        assert isinstance(data, dict)
        return list(data["result"])

    def alerts(self) -> list[dict]:
        """Every pending or firing alert: `[{"labels", "annotations", "state", "activeAt", "value"}, ...]`."""
        data = self.api("alerts")
        assert isinstance(data, dict)
        return list(data["alerts"])

    def targets(self) -> list[dict]:
        """The active scrape targets with their health (`up`, `lastError`)."""
        data = self.api("targets")
        assert isinstance(data, dict)
        return list(data["activeTargets"])

    def stop(self) -> None:
        """Stop the server and delete its files."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
