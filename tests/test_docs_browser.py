"""The docs site as a reader meets it: built strictly, served over loopback, opened in a real headless Chromium.

The quickstart, one guide and the generated HTTP reference render with their content and navigation, the search
index loads, and no request of theirs fails. With `REPLAY_SCREENSHOTS=DIR` each page's screenshot is saved there
(the issue's closing note carries them).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.browser import browser, require_browser

ROOT = Path(__file__).resolve().parent.parent
PAGES = {  # path in the site -> what its rendered text holds
    "quickstart/": ["Quickstart", "ReplayClient"],
    "guides/trainers/": ["megatron"],
    "reference/http/": ["/v1/ingest", "/v1/trainer/megatron", "/healthz"],
}


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    require_browser()
    out = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                    "-d", str(out)], cwd=ROOT, check=True, timeout=300)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


@pytest.mark.parametrize("path", list(PAGES))
def test_a_page_renders_with_its_content_and_nothing_fails(site, path):
    failed: list[str] = []
    with browser() as b:
        page = b.new_page(viewport={"width": 1280, "height": 900})
        page.on("requestfailed", lambda r: failed.append(r.url))
        page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        page.goto(site + path, wait_until="networkidle")
        text = page.inner_text("article")
        for wanted in PAGES[path]:
            assert wanted in text, f"{path}: {wanted!r} not rendered"
        assert page.locator("nav.md-nav").count() > 0  # the site's navigation is there
        shots = os.environ.get("REPLAY_SCREENSHOTS")
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(shots) / (path.strip("/").replace("/", "_") + ".png")), full_page=False)
    assert not failed, failed
