"""A real headless Chromium for the web-view tests, driven by Playwright for Python.

Uses Debian's `chromium` package (/usr/bin/chromium, or $REPLAY_CHROMIUM); Playwright's own
browser download is never used. Tests skip when neither Playwright nor Chromium is installed,
unless REPLAY_REQUIRE_ALL=1 (CI sets it: a missing browser then fails instead of skipping).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("REPLAY_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def require_browser():
    """The Playwright sync API and the Chromium path, or skip (fail under REPLAY_REQUIRE_ALL=1)."""
    strict = os.environ.get("REPLAY_REQUIRE_ALL") == "1"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if strict:
            raise
        pytest.skip("playwright is not installed (pip install playwright; never `playwright install`)")
    path = chromium_path()
    if path is None:
        if strict:
            raise RuntimeError("no Chromium at /usr/bin/chromium (apt-get install -y chromium)")
        pytest.skip("no Chromium at /usr/bin/chromium (apt-get install -y chromium)")
    return sync_playwright, path


@contextmanager
def browser():
    sync_playwright, path = require_browser()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


class PageWatch:
    """Collects console errors, page errors, dialogs and every request's URL for a page."""

    def __init__(self, page, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.urls: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: self.urls.append(r.url))

        def on_dialog(d):
            self.dialogs.append(d.message)
            d.dismiss()

        page.on("dialog", on_dialog)

    def foreign_urls(self) -> list[str]:
        return [u for u in self.urls if not u.startswith((self.base_url, "data:", "blob:"))]


def new_page(b, base_url: str, width: int = 1440, height: int = 900):
    context = b.new_context(viewport={"width": width, "height": height}, base_url=base_url)
    page = context.new_page()
    page.set_default_timeout(15_000)
    return page, PageWatch(page, base_url)


def goto_hash(page, base_url: str, fragment: str) -> None:
    """Navigate to `/#...` and wait until the page says it rendered (body[data-ready=1])."""
    page.goto(f"{base_url}/#{fragment}")
    page.wait_for_function("() => document.body.dataset.ready === '1'")


def set_hash(page, fragment: str) -> None:
    page.evaluate("f => { document.body.dataset.ready = '0'; location.hash = f; }", fragment)
    page.wait_for_function("() => document.body.dataset.ready === '1'")
