"""The web view's static files: everything ships in web/, nothing from elsewhere, data never as HTML.

No browser needed; tests/test_web_view.py drives the pages in Chromium.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from replay_service.app import WEB_DIR as WEB
from tests.support.service import calls

FILES = sorted(p for p in WEB.rglob("*") if p.is_file())
TEXT = {p: p.read_text() for p in FILES if p.suffix in {".html", ".js", ".css"}}
# The vendored uPlot names its home page in its licence banner (a comment: nothing is fetched from it).
VENDORED_BANNERS = {"vendor/uplot/uPlot.iife.min.js": ["https://github.com/leeoniya/uPlot"]}


def test_web_has_no_remote_urls():
    # Any http(s) URL in markup, code or styles would be a fetch from elsewhere (CDN, fonts).
    offenders = {str(p.relative_to(WEB)): re.findall(r"https?://[^\s\"')]+", t) for p, t in TEXT.items()}
    offenders = {k: [u for u in v if not u.startswith("https://arrow.apache.org/docs")
                     and u not in VENDORED_BANNERS.get(k, [])] for k, v in offenders.items()}
    assert not {k: v for k, v in offenders.items() if v}


def test_vendored_files_are_the_ones_their_readme_names():
    """Each vendored file is byte for byte the release its README's table names (sha256), so an upgrade or an
    edit shows in the table."""
    readme = (WEB / "vendor" / "uplot" / "README.md").read_text()
    named = dict(re.findall(r"^\| (\S+) \| ([0-9a-f]{64}) \|$", readme, re.M))
    assert set(named) == {"uPlot.iife.min.js", "uPlot.min.css", "LICENSE"}
    for name, digest in named.items():
        assert hashlib.sha256((WEB / "vendor" / "uplot" / name).read_bytes()).hexdigest() == digest, name
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


def test_a_checkout_serves_its_top_level_web():
    """The sources are the checkout's web/ (the wheel's copy is tests/test_wheel.py's); nothing left in the package."""
    root = Path(__file__).resolve().parent.parent
    assert WEB == root / "web" and (WEB / "index.html").is_file(), WEB
    assert not (root / "replay_service" / "web").exists()


def test_web_served_at_root(shared_service):
    base = shared_service.url
    index = calls.get(f"{base}/")
    assert index.status_code == 200 and "js/app.js" in index.text
    for p in FILES:
        rel = p.relative_to(WEB).as_posix()
        r = calls.get(f"{base}/{rel}")
        assert r.status_code == 200, rel
        if p.suffix == ".js":
            assert "javascript" in r.headers["content-type"], (rel, r.headers["content-type"])


def _js_const(path: str, name: str) -> str:
    """The text of `export const NAME = ...;` in a web/js module."""
    match = re.search(rf"^export const {name} = (.+?);$", (WEB / "js" / path).read_text(), flags=re.M | re.S)
    assert match, f"web/js/{path} has no `export const {name}`"
    return match.group(1)


def test_web_flag_table_is_replay_format_flag():
    from replay_format import Flag

    bits = json.loads(re.sub(r"(\w+):", r'"\1":', _js_const("dom.js", "FLAG_BITS")))
    assert bits == {f.name: int(f) for f in Flag}
    assert list(bits) == [f.name for f in sorted(Flag, key=int)]  # FLAGS (its keys) are in bit order
    assert _js_const("dom.js", "FLAGS") == "Object.keys(FLAG_BITS)"
    for table in ("FLAG_SHORT", "FLAG_COLORS", "FLAG_HELP"):
        keys = re.findall(r"(?:^|[{,])\s*([A-Z_]+): \"", _js_const("dom.js", table), flags=re.M)
        assert set(keys) == set(bits), table


def test_web_reads_the_route_format_the_service_writes():
    from replay_format import NO_TOKEN, route

    assert int(_js_const("routedata.js", "NO_TOKEN")) == NO_TOKEN
    assert json.loads(_js_const("routedata.js", "ROUTE_FORMAT")) == route.FORMAT
    assert int(_js_const("routedata.js", "ROUTE_MAJOR")) == route.VERSION.major
