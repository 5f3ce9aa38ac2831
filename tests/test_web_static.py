"""The web view's static files: everything ships in web/, nothing from elsewhere, data never as HTML.

No browser needed; tests/test_web_view.py drives the pages in Chromium.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

WEB = Path(__file__).resolve().parent.parent / "web"
FILES = sorted(p for p in WEB.rglob("*") if p.is_file())
TEXT = {p: p.read_text() for p in FILES if p.suffix in {".html", ".js", ".css"}}


def test_web_has_no_remote_urls():
    # Any http(s) URL in markup, code or styles would be a fetch from elsewhere (CDN, fonts).
    offenders = {str(p.relative_to(WEB)): re.findall(r"https?://[^\s\"')]+", t) for p, t in TEXT.items()}
    offenders = {k: [u for u in v if not u.startswith("https://arrow.apache.org/docs")] for k, v in offenders.items()}
    assert not {k: v for k, v in offenders.items() if v}
    for p, t in TEXT.items():
        assert "@import url(" not in t and "@font-face" not in t, p


def test_web_never_writes_html_from_data():
    sinks = re.compile(r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML|document\.write|\beval\(|new Function\(")
    for p, t in TEXT.items():
        if p.suffix == ".js":
            code = "\n".join(line for line in t.splitlines() if not line.strip().startswith("//"))
            assert not sinks.search(code), f"{p}: {sinks.search(code).group(0)}"


def test_web_csp_allows_only_same_origin():
    html = TEXT[WEB / "index.html"]
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp


def test_web_module_imports_resolve():
    for p, t in TEXT.items():
        if p.suffix != ".js":
            continue
        for spec in re.findall(r'^import .*? from "([^"]+)";', t, flags=re.M):
            assert spec.startswith("."), f"{p} imports {spec!r}: only relative modules shipped in web/"
            assert (p.parent / spec).resolve().is_file(), f"{p} imports missing {spec}"


def test_web_served_at_root(shared_service):
    base = shared_service.url
    index = httpx.get(f"{base}/")
    assert index.status_code == 200 and "js/app.js" in index.text
    for p in FILES:
        rel = p.relative_to(WEB).as_posix()
        r = httpx.get(f"{base}/{rel}")
        assert r.status_code == 200, rel
        if p.suffix == ".js":
            assert "javascript" in r.headers["content-type"], (rel, r.headers["content-type"])
